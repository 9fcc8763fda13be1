"""The engine side of the manager's state machine (test_state_machine.py): what an engine knows
of its sequences, and a shadow of the page CONTENTS it writes.

A device page is a list of `page_size` slots; computing position `pos` of a sequence writes
`(extra_key, tokens[:pos+1])` into its slot -- the K/V at a position depends on the whole
prefix, so stale or foreign data never compares equal by accident. Plans are executed exactly
as the proto orders them: swap_out, then copies in list order, then swap_in. check_consistent
then holds the manager to it:

- every computed slot of every live sequence holds that sequence's own prefix
  (prefix hits, dedup on swap-in, fork copy-on-write, truncation copies, swap
  round trips all serve the right K/V);
- every prefix-tree node holds the tokens its hash names;
- the engine's page tables (built from deltas only) equal the manager's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import strategies as st

from kvserve.kvcache_service.core import Admit, Commit, KVCacheManager, ManagerConfig, page_hashes
from kvserve.kvcache_service.contract.types import SeqState
from kvserve.kvcache_service.core.sequence import DROPPED, SWAPPED_OUT
from tests.kvcache.invariants import EventMirror, check_invariants

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
    dropped: set[int] = field(default_factory=set)   # page indices a slide released (never read again)
    slide_from: int | None = None  # its slides start here (the pages before are its sinks)

    def pending(self) -> bool:
        return self.computed != self.m_computed or len(self.tokens) != self.m_tokens

    def commit(self) -> Commit:
        return Commit(self.seq_id, self.computed, tuple(self.tokens[self.m_tokens:]))

    def committed(self) -> None:
        self.m_tokens, self.m_computed = len(self.tokens), self.computed


class ShadowEngine:
    """The engine's half of the machine: its sequences, the page contents it wrote, and what
    it learns from each answer of the manager."""

    def start(self, cfg: ManagerConfig, prefixes: list[list[int]]) -> None:
        self.cfg = cfg
        self.m = KVCacheManager(cfg)
        self.ps = cfg.page_size
        self.prefixes = prefixes
        self.epoch = 0
        self.rid_counter = 0
        self.seqs: dict[int, ESeq] = {}
        self.waiting: list[tuple[list[int], str]] = []  # preempted by RECOMPUTE, to re-admit
        self.dev: list[list] = [[None] * cfg.page_size for _ in range(cfg.num_pages)]
        self.cpu: list[list] = [[None] * cfg.page_size for _ in range(cfg.cpu_pages)]
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
        # (a batched copy leaves a page written twice undefined; a preempted fork's copy did once)
        assert len({d for _, d in copies}) == len(copies), f"two copies write one device page: {copies}"
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
            if i in s.dropped:
                continue
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
                     list(res.page_ids), len(parent.tokens), parent.computed,
                     dropped={i for i in parent.dropped if i < len(res.page_ids)})
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

    def check_consistent(self) -> None:
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
            assert {i for i, p in enumerate(ms.pages) if p == DROPPED} == s.dropped, (
                f"seq {sid}: manager dropped {ms.pages}, the engine slid {sorted(s.dropped)}")
            if not s.swapped:
                assert ms.state is SeqState.RUNNING
                assert [p for i, p in enumerate(ms.pages) if i not in s.dropped] == \
                    [p for i, p in enumerate(s.table) if i not in s.dropped], (
                    f"seq {sid}: manager table {ms.pages}, engine learnt {s.table}")
            else:
                assert ms.state is SeqState.SWAPPED
                assert len(ms.pages) >= len(s.table)
                for i, p in enumerate(s.table):
                    assert ms.pages[i] in (SWAPPED_OUT, DROPPED, p), f"swapped seq {sid}: device page {i} moved"
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

