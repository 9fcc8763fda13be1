"""A randomized engine drives a small KVCacheManager; every rule is followed by
check_invariants and by a shadow check of page CONTENTS.

The machine plays the model service: it keeps what an engine knows (its seq ids,
their tokens, how many are computed, their page tables as learnt from NeedResults
and StepPlans) and simulates the bytes. A device page is a list of `page_size`
slots; computing position `pos` of a sequence writes `(extra_key, tokens[:pos+1])`
into its slot -- the K/V at a position depends on the whole prefix, so stale or
foreign data never compares equal by accident. Plans are executed exactly as the
proto orders them: swap_out, then copies in list order, then swap_in. Then:

- every computed slot of every live sequence holds that sequence's own prefix
  (prefix hits, dedup on swap-in, fork copy-on-write, truncation copies, swap
  round trips all serve the right K/V);
- every prefix-tree node holds the tokens its hash names;
- the engine's page tables (built from deltas only) equal the manager's.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvserve.kvcache_service.core import (
    Admit,
    AlreadyExists,
    Commit,
    FailedPrecondition,
    Fork,
    Grow,
    InvalidArgument,
    KVCacheError,
    KVCacheManager,
    ManagerConfig,
    NotFound,
    PreemptionMode,
    ResourceExhausted,
    Resume,
    StepRequest,
    Truncation,
    page_hashes,
)
from kvserve.kvcache_service.core.sequence import SWAPPED_OUT
from kvserve.kvcache_service.contract.types import SeqState
from tests.kvcache.invariants import EventMirror, check_invariants, snapshot

TOKEN = st.integers(0, 2)  # a tiny alphabet: identical pages and prefix hits are common
COVERAGE: Counter[str] = Counter()


@dataclass
class ESeq:
    """What the engine knows of one of its sequences."""
    seq_id: int
    rid: str
    ek: str
    tokens: list[int]
    computed: int                  # slots the engine has written
    table: list[int]               # device pages, as learnt from results and plans
    m_tokens: int                  # tokens the manager knows (the rest are uncommitted)
    m_computed: int                # num_computed the manager knows
    swapped: bool = False          # the table keeps the pages from before the swap-out

    def pending(self) -> bool:
        return self.computed != self.m_computed or len(self.tokens) != self.m_tokens

    def commit(self) -> Commit:
        return Commit(self.seq_id, self.computed, tuple(self.tokens[self.m_tokens:]))

    def committed(self) -> None:
        self.m_tokens, self.m_computed = len(self.tokens), self.computed


class KVCacheMachine(RuleBasedStateMachine):

    # ------------------------------------------------------------ set-up

    @initialize(
        num_pages=st.integers(6, 24), page_size=st.sampled_from([2, 4]), max_seqs=st.integers(4, 8),
        cpu_pages=st.integers(0, 16),
        prefixes=st.lists(st.lists(TOKEN, max_size=10), min_size=1, max_size=3),
    )
    def setup(self, num_pages, page_size, max_seqs, cpu_pages, prefixes):
        self.cfg = ManagerConfig(num_pages=num_pages, page_size=page_size, max_seqs=max_seqs,
                                 cpu_pages=cpu_pages)
        self.m = KVCacheManager(self.cfg)
        self.ps = page_size
        self.prefixes = prefixes
        self.epoch = 0
        self.rid_counter = 0
        self.seqs: dict[int, ESeq] = {}
        self.waiting: list[tuple[list[int], str]] = []  # preempted by RECOMPUTE, to re-admit
        self.dev: list[list] = [[None] * page_size for _ in range(num_pages)]
        self.cpu: list[list] = [[None] * page_size for _ in range(cpu_pages)]
        self.registry: dict[int, tuple[str, tuple[int, ...]]] = {}  # page hash -> (extra key, prefix)
        self.events = EventMirror()
        self.order: list[int] = []  # running order: admitted, resumed, forked; oldest first

    # ----------------------------------------------------------- helpers

    def _rid(self) -> str:
        self.rid_counter += 1
        return f"r{self.rid_counter}"

    def _draw_prompt(self, data) -> tuple[list[int], str]:
        if self.waiting and data.draw(st.booleans(), label="re-admit"):
            return self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))
        prefix = data.draw(st.sampled_from(self.prefixes), label="prefix")
        suffix = data.draw(st.lists(TOKEN, min_size=1, max_size=2 * self.ps), label="suffix")
        ek = data.draw(st.sampled_from(["", "", "", "tenant-b"]), label="extra_key")
        return list(prefix) + suffix, ek

    def _draw_max_tokens(self, data) -> int | None:
        return data.draw(st.one_of(st.none(), st.integers(1, 3 * self.ps)), label="max_tokens")

    def _running(self) -> list[int]:
        return sorted(sid for sid, s in self.seqs.items() if not s.swapped)

    def _swapped(self) -> list[int]:
        return sorted(sid for sid, s in self.seqs.items() if s.swapped)

    def _flush(self, s: ESeq) -> None:
        """The engine commits what it computed before a fine-grained call on the sequence."""
        if s.pending():
            before = len(self.m.state.tree)
            stored = self.m.commit(s.commit())
            assert stored == len(self.m.state.tree) - before, "commit miscounts the pages it stored"
            s.committed()

    def _write(self, s: ESeq, start: int, end: int) -> None:
        ps, toks = self.ps, tuple(s.tokens)
        for pos in range(start, end):
            self.dev[s.table[pos // ps]][pos % ps] = (s.ek, toks[: pos + 1])

    def _register(self, s: ESeq) -> None:
        full = s.computed // self.ps * self.ps
        for i, h in enumerate(page_hashes(s.tokens[:full], self.ps, s.ek)):
            self.registry[h] = (s.ek, tuple(s.tokens[: (i + 1) * self.ps]))

    def _forward(self, s: ESeq, data) -> None:
        """The model computes what its slots allow, then samples when it reached the end."""
        target = min(len(s.table) * self.ps, len(s.tokens))
        if target > s.computed:
            new = target
            if data.draw(st.booleans(), label="partial chunk"):
                new = data.draw(st.integers(s.computed + 1, target), label="chunk end")
            self._write(s, s.computed, new)
            s.computed = new
        if s.computed == len(s.tokens):
            k = data.draw(st.sampled_from([1, 1, 1, 2]), label="sampled/draft tokens")
            s.tokens.extend(data.draw(st.lists(TOKEN, min_size=k, max_size=k), label="sampled"))
        self._register(s)

    def _execute(self, swap_out=(), copies=(), swap_in=()) -> None:
        """Runs a plan's copies in the proto's order."""
        assert len({d for _, d in swap_out}) == len(swap_out), f"two swap-outs share a CPU page: {swap_out}"
        assert len({d for _, d in swap_in}) == len(swap_in), f"two swap-ins share a device page: {swap_in}"
        for src, dst in swap_out:
            self.cpu[dst] = list(self.dev[src])
        for src, dst in copies:
            self.dev[dst] = list(self.dev[src])
        for src, dst in swap_in:
            self.dev[dst] = list(self.cpu[src])

    def _check_content(self, s: ESeq, what: str) -> None:
        ps, toks = self.ps, tuple(s.tokens)
        # A swapped sequence: the engine need not know where its pages went (a
        # Resume tells it); check the bytes where the manager says they are.
        cpu_of = {i: c for i, c, _ in self.m.state.seqs[s.seq_id].swapped} if s.swapped else {}
        for pos in range(s.computed):
            i = pos // ps
            if i in cpu_of:
                got, where = self.cpu[cpu_of[i]][pos % ps], f"CPU page {cpu_of[i]}"
            else:
                got, where = self.dev[s.table[i]][pos % ps], f"device page {s.table[i]}"
            want = (s.ek, toks[: pos + 1])
            assert got == want, (
                f"{what}: seq {s.seq_id} ({s.rid}) position {pos} in {where} holds "
                f"{got!r}, expected {want!r}")

    def _admitted(self, need: Admit, res) -> ESeq:
        ps = self.ps
        n = len(need.token_ids)
        assert res.replaces_table and res.granted
        assert 0 <= res.cached_tokens < n, f"admission served the last prompt token from cache: {res}"
        assert res.cached_tokens % ps == 0, f"cached_tokens {res.cached_tokens} is not whole pages"
        todo = n - res.cached_tokens
        if need.max_tokens is not None:
            todo = min(todo, need.max_tokens)
        assert res.num_tokens == todo, f"admission gave {res.num_tokens} tokens, expected {todo}"
        assert len(res.page_ids) == -(-(res.cached_tokens + todo) // ps), (
            f"admission: {len(res.page_ids)} pages for {res.cached_tokens} cached + {todo} tokens")
        s = ESeq(res.seq_id, need.request_id, need.extra_key, list(need.token_ids), res.cached_tokens,
                 list(res.page_ids), n, res.cached_tokens)
        assert res.seq_id not in self.seqs, f"admission reused live seq id {res.seq_id}"
        self.seqs[res.seq_id] = s
        self.order.append(res.seq_id)
        if res.cached_tokens:
            COVERAGE["prefix hit"] += 1
        return s

    def _forked(self, parent: ESeq, rid: str, res) -> ESeq:
        assert res.granted and res.replaces_table
        child = ESeq(res.seq_id, rid, parent.ek, list(parent.tokens), parent.computed,
                     list(res.page_ids), len(parent.tokens), parent.computed)
        assert len(child.table) == -(-parent.computed // self.ps), (
            f"fork child table {child.table} for {parent.computed} computed tokens")
        assert res.seq_id not in self.seqs
        self.seqs[res.seq_id] = child
        self.order.append(res.seq_id)
        return child

    def _truncated(self, s: ESeq, num_tokens: int) -> int:
        """Engine side of a truncation: tokens and pages past the new end go.
        Returns the new length."""
        new_len = len(s.tokens) - num_tokens
        del s.table[-(-new_len // self.ps):]
        del s.tokens[new_len:]
        s.computed = min(s.computed, new_len)
        s.m_tokens, s.m_computed = new_len, min(s.m_computed, new_len)
        return new_len

    def _claim_copy(self, s: ESeq, new_len: int, copies: list, ci: int, limit: int) -> int:
        """A truncation that leaves a partial last page which was shared or cached
        gets a copy of it: the next unclaimed copy (below `limit`, where the fork
        copies start) whose source is that page. Returns the next copy index."""
        if (new_len % self.ps and ci < limit and len(s.table) == -(-new_len // self.ps)
                and copies[ci][0] == s.table[-1]):
            s.table[-1] = copies[ci][1]
            COVERAGE["truncation copy"] += 1
            return ci + 1
        return ci

    def _swapped_out(self, s: ESeq) -> None:
        # Private pages move out, tail first; shared ones stay. The engine keeps its
        # table: a Resume hands it the whole new one. (The pairs of several victims
        # share one list, and a page freed by one victim and grown by the next can
        # appear twice; that is harmless, every swap-out reads before anything writes.)
        s.swapped = True
        self.order.remove(s.seq_id)

    def _resumed(self, s: ESeq, res, num_tokens: int) -> None:
        assert res.granted and res.replaces_table
        assert len(res.page_ids) * self.ps >= max(num_tokens, s.computed)
        COVERAGE["resume"] += 1
        s.table, s.swapped = list(res.page_ids), False
        self.order.append(s.seq_id)

    # -------------------------------------------------------------- Step

    @rule(data=st.data())
    def step(self, data):
        self._step(data)

    @precondition(lambda self: any(not s.swapped for s in self.seqs.values()))
    @rule(data=st.data())
    def step_under_pressure(self, data):
        """Resumes, admissions and forks first, then Grows that want more than is
        free: victims are taken from the tail, where this step's newcomers are."""
        self._step(data, pressure=True)

    def _step(self, data, pressure: bool = False):
        m, ps = self.m, self.ps
        ids = sorted(self.seqs)
        releases = []
        crowded = len(ids) >= self.cfg.max_seqs - 1  # the engine finishes requests too
        if ids and (crowded or data.draw(st.integers(0, 3), label="release?") == 0):
            releases = data.draw(st.lists(st.sampled_from(ids), unique=True, min_size=1, max_size=2),
                                 label="releases")
        live = [sid for sid in ids if sid not in releases]
        running = [sid for sid in live if not self.seqs[sid].swapped]
        swapped = [sid for sid in live if self.seqs[sid].swapped]

        truncs, commits, post_len, spec = [], [], {}, {}
        for sid in running:
            s = self.seqs[sid]
            post_len[sid] = len(s.tokens)
            if s.m_tokens >= 2 and data.draw(st.integers(0, 7), label="truncate?") == 0:
                n = data.draw(st.integers(1, s.m_tokens - 1), label="drop")
                truncs.append(Truncation(sid, n))
                if s.pending():  # speculative decoding: reject drafts, append the corrected token
                    spec[sid] = data.draw(TOKEN, label="corrected token")
                    post_len[sid] = s.m_tokens - n + 1
                else:
                    post_len[sid] = s.m_tokens - n
        for sid in running:
            s = self.seqs[sid]
            if sid in spec:
                new_len = post_len[sid] - 1
                commits.append(Commit(sid, min(s.computed, new_len), (spec[sid],)))
            elif s.pending():
                commits.append(s.commit())

        grows = []
        for sid in running:
            if data.draw(st.integers(0, 3), label="grow?"):
                if pressure:  # a little more than the last plan said was available
                    extra = ps * data.draw(st.integers(1, m.state.available() + 2), label="lookahead pages")
                else:
                    extra = data.draw(st.sampled_from([0, 0, 0, 1, ps, 3 * ps]), label="lookahead")
                grows.append(Grow(sid, post_len[sid] + extra))
        resumes = []
        for sid in swapped:
            if pressure or data.draw(st.booleans(), label="resume?"):
                n = data.draw(st.sampled_from([0, len(self.seqs[sid].tokens)]), label="resume tokens")
                resumes.append(Resume(sid, n))
        others = []
        for _ in range(data.draw(st.integers(0, 2), label="admissions")):
            prompt, ek = self._draw_prompt(data)
            others.append(Admit(self._rid(), prompt, ek, self._draw_max_tokens(data)))
        if running and data.draw(st.integers(0, 3), label="fork?") == 0:
            others.append(Fork(data.draw(st.sampled_from(running), label="parent"), self._rid()))
        others = data.draw(st.permutations(others), label="admit/fork order")
        if pressure:
            needs = resumes + others + grows
        else:
            needs = grows + resumes + others
        if not pressure and data.draw(st.integers(0, 3), label="shuffle needs?") == 0:
            needs = data.draw(st.permutations(needs), label="need order")
        mode = data.draw(st.sampled_from([PreemptionMode.RECOMPUTE, PreemptionMode.SWAP]), label="mode")
        req = StepRequest(self.epoch, releases, truncs, commits, needs, mode)

        before = snapshot(m.state)
        free_ids = m.state.seq_ids.free_ids()
        try:
            plan = m.step(req)
        except ResourceExhausted:
            # The one refusal a well-formed Step may meet: no page for a truncation's copy.
            assert truncs, "Step raised ResourceExhausted without truncations"
            assert snapshot(m.state) == before, "a refused Step changed the state"
            for need in needs:  # the prompts go back to the queue
                if isinstance(need, Admit):
                    self.waiting.append((list(need.token_ids), need.extra_key))
            COVERAGE["step refused: truncation copy"] += 1
            return

        # --- what the engine learns, in the order the manager applied it
        for sid in releases:
            if not self.seqs.pop(sid).swapped:
                self.order.remove(sid)
        before_order = list(self.order)
        trunc_len = {}
        for t in truncs:
            s = self.seqs[t.seq_id]
            if t.seq_id in spec:
                # Drop the uncommitted tail first: the truncation counts manager-known tokens.
                del s.tokens[s.m_tokens:]
                s.computed = min(s.computed, s.m_tokens)
            trunc_len[t.seq_id] = self._truncated(s, t.num_tokens)
            if t.seq_id in spec:
                s.tokens.append(spec[t.seq_id])
        # plan.copies = truncation copies, then one copy per fork of a parent with a
        # partial page -- also for a child granted and then preempted (its request
        # id is in plan.preempted). That is how the engine tells them apart.
        preempted_rids = {pre.request_id for pre in plan.preempted}
        forks = [(need, res) for need, res in zip(needs, plan.results) if isinstance(need, Fork)
                 and (res.granted or need.request_id in preempted_rids)]
        fork_copies = [need for need, _ in forks if self.seqs[need.parent_seq_id].computed % ps]
        limit = len(plan.copies) - len(fork_copies)
        assert limit >= 0, f"plan has {len(plan.copies)} copies for {len(fork_copies)} forks"
        ci = 0
        for t in truncs:
            ci = self._claim_copy(self.seqs[t.seq_id], trunc_len[t.seq_id], plan.copies, ci, limit)
        assert ci == limit, f"copies {plan.copies[ci:limit]} belong to no truncation or fork"
        for need, (src, dst) in zip(fork_copies, plan.copies[limit:]):
            parent = self.seqs[need.parent_seq_id]
            assert src == parent.table[parent.computed // ps], (
                f"fork copy {src}->{dst} does not read the parent's partial page {parent.table}")
        for c in commits:
            self.seqs[c.seq_id].committed()
        assert len(plan.results) == len(needs), "one result per need"
        touched: list[ESeq] = []
        for need, res in zip(needs, plan.results):
            if isinstance(need, Grow):
                assert res.seq_id == need.seq_id
                if res.granted:
                    s = self.seqs[need.seq_id]
                    assert not res.replaces_table
                    s.table.extend(res.page_ids)
                    assert len(s.table) * ps >= need.num_tokens, f"grow {need} got {res}"
                    touched.append(s)
            elif isinstance(need, Resume):
                assert res.seq_id == need.seq_id
                if not res.granted and need.seq_id in {p.seq_id for p in plan.preempted}:
                    COVERAGE["resumed, then preempted"] += 1
                if res.granted:
                    s = self.seqs[need.seq_id]
                    self._resumed(s, res, need.num_tokens)
                    touched.append(s)
            elif isinstance(need, Admit):
                if res.granted:
                    touched.append(self._admitted(need, res))
                else:
                    self.waiting.append((list(need.token_ids), need.extra_key))
            elif res.granted:
                touched.append(self._forked(self.seqs[need.parent_seq_id], need.request_id, res))
                COVERAGE["fork"] += 1
        new_ids = {res.seq_id for res in plan.results}
        for pre in plan.preempted:
            s = self.seqs.get(pre.seq_id)
            if s is None or s.rid != pre.request_id:
                # A sequence made in this step; its result was turned into a refusal.
                assert pre.seq_id in new_ids and pre.mode is PreemptionMode.RECOMPUTE, pre
                assert pre.request_id not in m.state.by_request, pre
                continue
            if pre.mode is PreemptionMode.RECOMPUTE:
                assert pre.seq_id not in m.state.seqs, f"{pre} but the sequence is still live"
                del self.seqs[pre.seq_id]
                if not s.swapped:  # (a swapped one resumed and preempted in this step was never listed)
                    self.order.remove(pre.seq_id)
                self.waiting.append((list(s.tokens), s.ek))
                COVERAGE["preempt recompute"] += 1
            else:
                assert m.state.seqs[pre.seq_id].state is SeqState.SWAPPED, pre
                assert mode is PreemptionMode.SWAP, "SWAP preemption the engine did not ask for"
                self._swapped_out(s)
                COVERAGE["preempt swap"] += 1
        assert plan.available_pages == m.state.available()
        old_victims = [v for v in (pre.seq_id for pre in plan.preempted) if v in before_order]
        assert old_victims == before_order[::-1][: len(old_victims)], (
            f"victims {old_victims} are not the tail of the running order {before_order}")
        # Seq ids are FIFO: released ones queue at the back at once, preempted
        # (RECOMPUTE) ones at the end of the step; new sequences take from the front.
        rid_to_id = {pre.request_id: pre.seq_id for pre in plan.preempted}
        rid_to_id.update((need.request_id, res.seq_id) for need, res in zip(needs, plan.results)
                         if isinstance(need, (Admit, Fork)) and res.granted)
        taken = [rid_to_id[need.request_id] for need in needs
                 if isinstance(need, (Admit, Fork)) and need.request_id in rid_to_id]
        queue = free_ids + list(releases)
        assert taken == queue[: len(taken)], f"new seq ids {taken}, FIFO queue was {queue}"
        recomputed = [pre.seq_id for pre in plan.preempted if pre.mode is PreemptionMode.RECOMPUTE]
        assert m.state.seq_ids.free_ids() == queue[len(taken):] + recomputed, (
            f"free seq ids {m.state.seq_ids.free_ids()}, expected {queue[len(taken):] + recomputed}")

        self._execute(plan.swap_out, plan.copies, plan.swap_in)
        for s in touched:
            if s.seq_id in self.seqs and self.seqs[s.seq_id] is s and not s.swapped:
                self._check_content(s, "after executing the StepPlan")
        for s in touched:
            if s.seq_id in self.seqs and self.seqs[s.seq_id] is s and not s.swapped:
                self._forward(s, data)
        del self.waiting[:-8]
        COVERAGE["step"] += 1

    # ------------------------------------------------- fine-grained calls

    @rule(data=st.data())
    def allocate_admit(self, data):
        m, ps = self.m, self.ps
        self._free_a_seq_id(data)
        prompt, ek = self._draw_prompt(data)
        need = Admit(self._rid(), prompt, ek, self._draw_max_tokens(data))
        matched, _ = m.match_prefix(prompt, ek)
        expect_cached = min(matched, (len(prompt) - 1) // ps * ps)
        check = m.can_allocate(need)
        if not check.ok:
            self._refused(need)
            self.waiting.append((prompt, ek))
            return
        free_ids = m.state.seq_ids.free_ids()
        res, swap_in, copies = m.try_allocate(need)
        assert not swap_in and not copies
        assert [res.seq_id] + m.state.seq_ids.free_ids() == free_ids, "seq ids are not handed out FIFO"
        assert check.pages_needed == len(res.page_ids) - res.cached_tokens // ps
        assert res.cached_tokens == expect_cached, (
            f"admission hit {res.cached_tokens} tokens, the tree holds {expect_cached} of the prompt")
        s = self._admitted(need, res)
        self._check_content(s, "after a prefix hit (allocate)")
        if data.draw(st.booleans(), label="compute now?"):
            self._forward(s, data)

    @precondition(lambda self: any(not s.swapped for s in self.seqs.values()))
    @rule(data=st.data())
    def allocate_grow(self, data):
        s = self.seqs[data.draw(st.sampled_from(self._running()), label="seq")]
        n = len(s.tokens) + data.draw(st.sampled_from([0, 1, self.ps, 3 * self.ps]), label="lookahead")
        need = Grow(s.seq_id, n)
        check = self.m.can_allocate(need)
        if not check.ok:
            self._refused(need)
            return
        res, swap_in, copies = self.m.try_allocate(need)
        assert res.granted and not swap_in and not copies and not res.replaces_table
        assert len(res.page_ids) == check.pages_needed
        s.table.extend(res.page_ids)
        assert len(s.table) * self.ps >= n

    @precondition(lambda self: any(s.swapped for s in self.seqs.values()))
    @rule(data=st.data())
    def swap_in(self, data):
        s = self.seqs[data.draw(st.sampled_from(self._swapped()), label="seq")]
        n = data.draw(st.sampled_from([0, len(s.tokens)]), label="resume tokens")
        need = Resume(s.seq_id, n)
        check = self.m.can_allocate(need)
        if not check.ok:
            self._refused(need)
            return
        swapped_pages = len(self.m.state.seqs[s.seq_id].swapped)
        if n == 0 and data.draw(st.booleans(), label="by request id?"):  # the SwapIn RPC's way
            need = Resume(self.m.seq_id_of(s.rid))
        res, swap_in, copies = self.m.try_allocate(need)
        assert not copies
        self._resumed(s, res, n)
        if len(swap_in) < swapped_pages:
            COVERAGE["swap-in dedup"] += 1
        self._execute(swap_in=swap_in)
        self._check_content(s, "after swap-in")

    @precondition(lambda self: any(not s.swapped for s in self.seqs.values()))
    @rule(data=st.data())
    def swap_out(self, data):
        s = self.seqs[data.draw(st.sampled_from(self._running()), label="seq")]
        self._flush(s)
        before = snapshot(self.m.state)
        try:
            copies = self.m.swap_out(s.seq_id)
        except ResourceExhausted:
            assert snapshot(self.m.state) == before, "a refused swap-out changed the state"
            COVERAGE["swap out refused"] += 1
            return
        self._swapped_out(s)
        ms = self.m.state.seqs[s.seq_id]
        assert sorted(copies) == sorted((s.table[i], c) for i, c, _ in ms.swapped), (
            f"swap_out copies {copies} vs the manager's record {ms.swapped}")
        self._execute(swap_out=copies)
        COVERAGE["swap out"] += 1

    @precondition(lambda self: any(not s.swapped for s in self.seqs.values()))
    @rule(data=st.data())
    def fork(self, data):
        self._free_a_seq_id(data)
        if not self._running():
            return
        parent = self.seqs[data.draw(st.sampled_from(self._running()), label="parent")]
        self._flush(parent)
        rid = self._rid()
        need = Fork(parent.seq_id, rid)
        check = self.m.can_allocate(need)
        if not check.ok:
            self._refused(need)
            return
        res, swap_in, copies = self.m.try_allocate(need)
        assert not swap_in
        assert len(copies) == check.pages_needed == (1 if parent.computed % self.ps else 0)
        child = self._forked(parent, rid, res)
        self._execute(copies=copies)
        self._check_content(child, "after fork")
        COVERAGE["fork"] += 1

    @precondition(lambda self: any(not s.swapped and len(s.tokens) >= 2 for s in self.seqs.values()))
    @rule(data=st.data())
    def truncate(self, data):
        s = self.seqs[data.draw(st.sampled_from(
            [sid for sid in self._running() if len(self.seqs[sid].tokens) >= 2]), label="seq")]
        self._flush(s)
        n = data.draw(st.integers(1, len(s.tokens) - 1), label="drop")
        before = snapshot(self.m.state)
        try:
            table, freed, copies = self.m.truncate(s.seq_id, n)
        except ResourceExhausted:
            assert snapshot(self.m.state) == before, "a refused truncation changed the state"
            return
        new_len = self._truncated(s, n)
        assert table == self.m.state.seqs[s.seq_id].pages
        assert self._claim_copy(s, new_len, copies, 0, len(copies)) == len(copies), (
            f"truncate: copies {copies} do not replace the new last page")
        self._execute(copies=copies)
        self._check_content(s, "after truncation")

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data):
        m = self.m
        s = self.seqs.pop(data.draw(st.sampled_from(sorted(self.seqs)), label="seq"))
        if not s.swapped:
            self.order.remove(s.seq_id)
        seq_id = m.seq_id_of(s.rid) if data.draw(st.booleans()) else s.seq_id
        seq = m.state.seqs[seq_id]
        private = [p for p in seq.pages if p != SWAPPED_OUT and m.state.pool.ref[p] == 1]
        want_freed = sum(1 for p in private if not m.state.tree.is_node(p))
        free_ids = m.state.seq_ids.free_ids()
        freed, cached = m.release(seq_id)
        assert m.state.seq_ids.free_ids() == free_ids + [s.seq_id], "a released seq id must queue at the back"
        assert (freed, cached) == (want_freed, len(private) - want_freed), (
            f"release returned ({freed}, {cached}), expected ({want_freed}, "
            f"{len(private) - want_freed})")

    @precondition(lambda self: any(not s.swapped and s.pending() for s in self.seqs.values()))
    @rule(data=st.data())
    def commit(self, data):
        sid = data.draw(st.sampled_from([i for i in self._running() if self.seqs[i].pending()]))
        self._flush(self.seqs[sid])

    @precondition(lambda self: any(not s.swapped for s in self.seqs.values()))
    @rule(data=st.data())
    def forward(self, data):
        self._forward(self.seqs[data.draw(st.sampled_from(self._running()), label="seq")], data)

    @precondition(lambda self: len(self.seqs) >= 2)
    @rule(how=st.sampled_from(["same epoch", "new epoch", "admin reset"]))
    def register(self, how):
        m = self.m
        if how == "same epoch" and self.epoch:
            before = snapshot(m.state)
            assert m.register(self.epoch, self.ps, self.cfg.num_pages) is False
            assert snapshot(m.state) == before, "re-registering the same epoch changed the state"
            return
        if how == "admin reset":
            m.reset()  # (the engine is told out of band; the epoch stays)
        else:
            self.epoch += 1
            assert m.register(self.epoch, self.ps, self.cfg.num_pages) is True
        # The model service restarted: its bytes are gone, its requests wait again.
        self.waiting.extend((s.tokens, s.ek) for s in self.seqs.values())
        del self.waiting[:-8]
        self.seqs.clear()
        self.order.clear()
        self.dev = [[None] * self.ps for _ in self.dev]
        self.cpu = [[None] * self.ps for _ in self.cpu]
        assert m.stats().used_pages == 0 and m.stats().tree_pages == 0
        COVERAGE["register"] += 1

    def _free_a_seq_id(self, data) -> None:
        """With every seq id taken, the engine finishes a request before it asks for another."""
        if not len(self.m.state.seq_ids) and self.seqs and data.draw(st.integers(0, 3), label="finish one?"):
            self.release(data)

    def _refused(self, need) -> None:
        """can_allocate said no: allocate must refuse it too, changing nothing."""
        before = snapshot(self.m.state)
        with pytest.raises(ResourceExhausted):
            self.m.try_allocate(need)
        assert snapshot(self.m.state) == before, f"a refused allocate({need}) changed the state"
        COVERAGE["allocate refused: " + ("seq ids" if not len(self.m.state.seq_ids) else "pages")] += 1

    # --------------------------------------------------------- bad inputs

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def bad_input(self, data):
        """A request with one deliberate error (after valid parts): the right
        KVCacheError subclass, and not a single change."""
        m = self.m
        kinds = [k for k, need in BAD_INPUTS.items() if _targets(m, need)]
        kind = data.draw(st.sampled_from(kinds), label="bad input")
        targets = _targets(m, BAD_INPUTS[kind])
        target = data.draw(st.sampled_from(targets), label="target") if targets != [None] else None
        # Valid parts that must not be applied when the request fails.
        others = [sid for sid in sorted(self.seqs) if sid != target]
        releases = data.draw(st.lists(st.sampled_from(others), unique=True, max_size=2)) if others else []
        commits = [s.commit() for sid, s in sorted(self.seqs.items())
                   if sid not in releases and sid != target and not s.swapped and s.pending()]
        call, exc = bad_call(m, kind, target, releases, commits, self._rid())
        expect_refusal(m, kind, call, exc)
        COVERAGE["bad input"] += 1

    # -------------------------------------------------------- invariants

    @invariant()
    def consistent(self):
        if not hasattr(self, "m"):
            return
        m, ps = self.m, self.ps
        check_invariants(m.state)
        evicted = self.events.sync(m.state)
        COVERAGE["evictions"] += len(evicted)
        assert set(m.state.seqs) == set(self.seqs), (
            f"manager holds seq ids {sorted(m.state.seqs)}, the engine {sorted(self.seqs)}")
        assert list(m.state.running) == self.order, (
            f"running order {list(m.state.running)}, the engine expects {self.order}")
        for sid, s in self.seqs.items():
            ms = m.state.seqs[sid]
            assert ms.request_id == s.rid
            assert ms.tokens == s.tokens[: s.m_tokens] and len(ms.tokens) == s.m_tokens, (
                f"seq {sid}: manager tokens {ms.tokens}, engine {s.tokens} ({s.m_tokens} committed)")
            assert ms.num_computed == s.m_computed, (
                f"seq {sid}: manager computed {ms.num_computed}, engine committed {s.m_computed}")
            if not s.swapped:
                assert ms.state is SeqState.RUNNING
                assert ms.pages == s.table, (
                    f"seq {sid}: manager table {ms.pages}, engine learnt {s.table}")
            else:
                assert ms.state is SeqState.SWAPPED
                assert len(ms.pages) >= len(s.table)
                for i, p in enumerate(s.table):
                    assert ms.pages[i] in (SWAPPED_OUT, p), f"swapped seq {sid}: device page {i} moved"
            self._check_content(s, "shadow check")
            if ms.diverged_at is not None:
                COVERAGE["diverged sequence"] += 1
        for h, p in m.state.tree.page_of.items():
            assert h in self.registry, f"tree node page {p} holds tokens the engine never computed"
            ek, prefix = self.registry[h]
            base = len(prefix) - ps
            for j in range(ps):
                want = (ek, prefix[: base + j + 1])
                assert self.dev[p][j] == want, (
                    f"tree node page {p} (hash {h:#x}) slot {j} holds {self.dev[p][j]!r}, "
                    f"its hash names {want!r}")


# ----------------------------------------------------------------------------
# Bad inputs: each names what it needs as a target; bad_call builds the call.

BAD_INPUTS = {
    "stale epoch": None, "unknown release": None, "admit empty": None,
    "admit negative token": None, "admit token too big": None, "admit max_tokens 0": None,
    "admit twice in a step": None, "unknown grow": None, "fork empty rid": None,
    "register epoch 0": None, "register page_size": None, "register num_pages": None,
    "match empty": None, "resolve unknown request": None, "allocate unknown": None,
    "double release": "any", "admit live rid": "any", "fork live rid": "any",
    "grow zero": "running", "resume running": "running", "commit beyond slots": "running",
    "commit beyond tokens": "running", "commit negative token": "running",
    "release and commit": "running", "release and grow": "running",
    "truncate everything": "running", "truncate zero": "running", "truncate twice": "running",
    "two needs": "running", "commit twice": "running", "can_allocate grow zero": "running",
    "commit call beyond slots": "running", "truncate call everything": "running",
    "swap-in call running": "running", "commit below computed": "computed",
    "grow swapped": "swapped", "fork swapped": "swapped", "commit swapped": "swapped",
    "swap-out call swapped": "swapped", "truncate swapped": "swapped",
}


def _targets(m: KVCacheManager, need: str | None) -> list:
    """The seq ids a bad input of this kind can name ([None]: it names none)."""
    if need is None:
        return [None]
    running = sorted(sid for sid, s in m.state.seqs.items() if s.state is SeqState.RUNNING)
    return {
        "any": sorted(m.state.seqs),
        "running": running,
        "computed": [sid for sid in running if m.state.seqs[sid].num_computed > 0],
        "swapped": sorted(sid for sid, s in m.state.seqs.items() if s.state is SeqState.SWAPPED),
    }[need]


def bad_call(m: KVCacheManager, kind: str, sid: int | None, releases: list[int],
             commits: list[Commit], new_rid: str):
    """(a call that must fail, the KVCacheError class it must raise). Steps carry
    the valid `releases` and `commits` too, which must not be applied."""
    ps = m.page_size
    unknown = next(i for i in range(10_000) if i not in m.state.seqs)
    live = [i for i in sorted(m.state.seqs) if i not in releases and i != sid
            and m.state.seqs[i].state is SeqState.RUNNING]
    fine = [Grow(live[0], len(m.state.seqs[live[0]].tokens))] if live else []

    def step(**kw):
        base = dict(epoch=m.epoch, releases=releases, commits=commits)
        base.update(kw)
        return lambda: m.step(StepRequest(**base))

    if sid is None:
        return {
            "stale epoch": (step(epoch=m.epoch + 1), FailedPrecondition),
            "unknown release": (step(releases=releases + [unknown]), NotFound),
            "admit empty": (step(needs=fine + [Admit(new_rid, [])]), InvalidArgument),
            "admit negative token": (step(needs=[Admit(new_rid, [1, -1])]), InvalidArgument),
            "admit token too big": (step(needs=fine + [Admit(new_rid, [2**31])]), InvalidArgument),
            "admit max_tokens 0": (step(needs=[Admit(new_rid, [1], max_tokens=0)]), InvalidArgument),
            "admit twice in a step": (step(needs=[Admit(new_rid, [1]), Admit(new_rid, [2])]),
                                      AlreadyExists),
            "unknown grow": (step(needs=fine + [Grow(unknown, 1)]), NotFound),
            "fork empty rid": (step(needs=[Fork(live[0], "")]) if live
                               else step(needs=[Admit("", [1])]), InvalidArgument),
            "register epoch 0": (lambda: m.register(0, ps, m.state.pool.num_pages), InvalidArgument),
            "register page_size": (lambda: m.register(m.epoch + 1, ps + 1, m.state.pool.num_pages),
                                   InvalidArgument),
            "register num_pages": (lambda: m.register(m.epoch + 1, ps, m.state.pool.num_pages + 1),
                                   InvalidArgument),
            "match empty": (lambda: m.match_prefix([]), InvalidArgument),
            "resolve unknown request": (lambda: m.seq_id_of("no-such-request"), NotFound),
            "allocate unknown": (lambda: m.try_allocate(Grow(unknown, 1)), NotFound),
        }[kind]
    seq = m.state.seqs[sid]
    n, computed, slots = len(seq.tokens), seq.num_computed, len(seq.pages) * ps
    over = Commit(sid, slots + 1, tuple([0] * (slots + 1)))
    return {
        "double release": (step(releases=[sid, sid]), InvalidArgument),
        "admit live rid": (step(needs=fine + [Admit(seq.request_id, [1, 2])]), AlreadyExists),
        "fork live rid": (step(needs=[Fork(live[0], seq.request_id)]) if live
                          else (lambda: m.try_allocate(Admit(seq.request_id, [1]))), AlreadyExists),
        "grow zero": (step(needs=[Grow(sid, 0)]), InvalidArgument),
        "resume running": (step(needs=[Resume(sid)]), FailedPrecondition),
        "commit beyond slots": (step(commits=commits + [over]), InvalidArgument),
        "commit beyond tokens": (step(commits=commits + [Commit(sid, n + 1)]), InvalidArgument),
        "commit negative token": (step(commits=commits + [Commit(sid, computed, (1, -3))]),
                                  InvalidArgument),
        "commit below computed": (step(commits=commits + [Commit(sid, computed - 1)]), InvalidArgument),
        "release and commit": (step(releases=releases + [sid],
                                    commits=commits + [Commit(sid, computed)]), InvalidArgument),
        "release and grow": (step(releases=releases + [sid], needs=fine + [Grow(sid, n)]),
                             InvalidArgument),
        "truncate everything": (step(truncations=[Truncation(sid, n)]), InvalidArgument),
        "truncate zero": (step(truncations=[Truncation(sid, 0)]), InvalidArgument),
        # (dropping to a page boundary: no copy, so no page shortage can answer first)
        "truncate twice": (step(truncations=[Truncation(sid, n % ps or ps)] * 2)
                           if (n % ps or ps) < n else step(truncations=[Truncation(sid, n)]),
                           InvalidArgument),
        "two needs": (step(needs=[Grow(sid, 1), Grow(sid, 2)]), InvalidArgument),
        "commit twice": (step(commits=[Commit(sid, computed), Commit(sid, computed)]), InvalidArgument),
        "can_allocate grow zero": (lambda: m.can_allocate(Grow(sid, 0)), InvalidArgument),
        "commit call beyond slots": (lambda: m.commit(over), InvalidArgument),
        "truncate call everything": (lambda: m.truncate(sid, n), InvalidArgument),
        "swap-in call running": (lambda: m.try_allocate(Resume(sid)), FailedPrecondition),
        "grow swapped": (step(needs=[Grow(sid, 1)]), FailedPrecondition),
        "fork swapped": (step(needs=[Fork(sid, new_rid)]), FailedPrecondition),
        "commit swapped": (step(commits=commits + [Commit(sid, computed)]), FailedPrecondition),
        "swap-out call swapped": (lambda: m.swap_out(sid), FailedPrecondition),
        "truncate swapped": (step(truncations=[Truncation(sid, 1)]), FailedPrecondition),
    }[kind]


def expect_refusal(m: KVCacheManager, kind: str, call, exc) -> None:
    before = snapshot(m.state)
    with pytest.raises(KVCacheError) as info:
        call()
    assert type(info.value) is exc, f"{kind}: raised {type(info.value).__name__}: {info.value}"
    assert snapshot(m.state) == before, f"{kind}: the failed call changed the state"
    check_invariants(m.state)




def _watch_mid_step(monkeypatch) -> None:
    """Check the invariants after each need a Step serves (seq ids and CPU pages
    may be pending inside a Step), where the internals still look like this."""
    from kvserve.kvcache_service.core import step as step_mod

    cls = getattr(step_mod, "_Step", None)
    names = [n for n in ("_grow", "_admit", "_resume", "_fork") if hasattr(cls, n)] or ["_serve"]
    for name in names:
        serve = getattr(cls, name, None)
        if serve is None:
            continue

        def watched(self, need, _serve=serve):
            result = _serve(self, need)
            check_invariants(self.state, mid_step=True)
            COVERAGE["mid-step checks"] += 1
            return result

        monkeypatch.setattr(cls, name, watched)


def test_manager_state_machine(monkeypatch):
    _watch_mid_step(monkeypatch)
    COVERAGE.clear()
    run_state_machine_as_test(KVCacheMachine, settings=settings(
        # KVCACHE_EXAMPLES=2000 for a deeper local hunt.
        max_examples=int(os.environ.get("KVCACHE_EXAMPLES", 60)), stateful_step_count=40, deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much]))
    print("coverage:", dict(sorted(COVERAGE.items())))
    for what in ("step", "prefix hit", "evictions", "preempt recompute", "fork", "bad input"):
        assert COVERAGE[what] > 0, f"the machine never reached: {what} ({dict(COVERAGE)})"


# ----------------------------------------------------------------------------
# Reproductions of core bugs the machine (or reading the core) found. A strict
# xfail turns into a failure the day the fix lands: then drop the marker.


def test_step_commit_after_truncation_checks_real_slots():
    m = KVCacheManager(ManagerConfig(num_pages=8, page_size=4, max_seqs=4))
    res, _, _ = m.try_allocate(Admit("a", [1, 2, 3, 4]))  # one page
    sid = res.seq_id
    # Computed the prompt; eight draft tokens appended, no slots for them yet.
    m.commit(Commit(sid, 4, [5, 6, 7, 8, 9, 10, 11, 12]))
    check_invariants(m.state)
    before = snapshot(m.state)
    # Drop 2 of the 12 tokens, then claim 8 computed: the sequence holds 4 slots.
    with pytest.raises(InvalidArgument):
        m.step(StepRequest(truncations=[Truncation(sid, 2)], commits=[Commit(sid, 8)]))
    assert snapshot(m.state) == before  # "a call that raises has changed nothing"
    check_invariants(m.state)


def test_resume_preempted_in_its_step_publishes_nothing():
    """A Resume granted and then preempted in the same Step: its swap-in copies are
    dropped, so the pages it would have put back into the tree were never written
    and must not be served as prefix hits (regression: swap_in used to publish at once)."""
    ps = 2
    m = KVCacheManager(ManagerConfig(num_pages=6, page_size=ps, max_seqs=4, cpu_pages=8))
    a_tokens = [1, 2, 3, 4, 5]
    a = m.try_allocate(Admit("a", a_tokens))[0].seq_id
    m.commit(Commit(a, 5, [6]))                  # pages 0, 1 enter the tree
    m.swap_out(a)                        # they stay cached, parked
    b = m.try_allocate(Admit("b", [9] * 9))[0].seq_id    # evicts one of them
    m.commit(Commit(b, 9, [9]))
    m.release(b)
    c = m.try_allocate(Admit("c", [7, 7, 7]))[0].seq_id  # evicts the other
    m.commit(Commit(c, 3, [7]))
    hashes = page_hashes(a_tokens, ps)
    assert [m.state.tree.get(h) for h in hashes] == [None, None]
    # A resumes (its two cached pages are copied back from the CPU), then c's Grow
    # does not fit and preempts the tail of the running order: a.
    plan = m.step(StepRequest(needs=[Resume(a), Grow(c, 8)]))
    assert [(p.seq_id, p.mode) for p in plan.preempted] == [(a, PreemptionMode.RECOMPUTE)]
    assert plan.swap_in == [] and not plan.results[0].granted and plan.results[1].granted
    written = {dst for _, dst in plan.swap_in} | {dst for _, dst in plan.copies}
    for i, h in enumerate(hashes):
        page = m.state.tree.get(h)
        assert page is None or page in written, (
            f"page {i} of the preempted sequence is served from the tree at page {page}, "
            "which no copy in this plan writes")
    check_invariants(m.state)
    # Re-admitting the prompt must compute it, not hit garbage.
    assert m.match_prefix(a_tokens)[0] == 0


def _rich_manager() -> KVCacheManager:
    """Running sequences with and without computed tokens, a prefix hit, a swapped one."""
    m = KVCacheManager(ManagerConfig(num_pages=16, page_size=2, max_seqs=6, cpu_pages=8))
    a = m.try_allocate(Admit("a", [1, 2, 3, 4, 5]))[0].seq_id
    m.commit(Commit(a, 5, [6]))
    b = m.try_allocate(Admit("b", [1, 2, 3, 4, 9]))[0].seq_id  # hits a's two full pages
    m.commit(Commit(b, 5, [7]))
    c = m.try_allocate(Admit("c", [8, 8, 8]))[0].seq_id
    m.commit(Commit(c, 3, [8]))
    m.swap_out(c)
    m.try_allocate(Admit("d", [5, 5, 5, 5]))  # nothing computed yet
    check_invariants(m.state)
    return m


@pytest.mark.parametrize("kind", sorted(BAD_INPUTS))
def test_bad_input_is_refused_and_changes_nothing(kind):
    """Every bad input, against every sequence it can name, alone and after valid
    releases and commits in the same Step: the right error, no change at all."""
    targets = _targets(_rich_manager(), BAD_INPUTS[kind])
    assert targets, f"the fixture has no sequence to try {kind!r} on"
    for target in targets:
        for with_valid_parts in (False, True):
            m = _rich_manager()
            d = m.state.by_request["d"]
            others = [sid for sid in sorted(m.state.seqs) if sid not in (target, d)]
            releases = others[-1:] if with_valid_parts else []
            commits = [Commit(d, 2)] if with_valid_parts and target != d else []
            call, exc = bad_call(m, kind, target, releases, commits, "new-request")
            expect_refusal(m, kind, call, exc)
