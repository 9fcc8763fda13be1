"""Step as the engine drives it, for the manager's state machine: a random StepRequest built from
the shadow engine's sequences (releases, truncations with speculative-decoding rollbacks,
commits, grows, resumes, admissions and forks, in the engine's priority order or shuffled),
run, and its plan checked and applied the way an engine applies it."""

from __future__ import annotations


from hypothesis import strategies as st

from kvserve.kvcache_service.core import (
    Admit,
    Commit,
    Fork,
    Grow,
    PreemptionMode,
    ResourceExhausted,
    Resume,
    Slide,
    StepRequest,
    Truncation,
)
from kvserve.kvcache_service.contract.types import SeqState
from tests.kvcache.invariants import snapshot
from tests.kvcache.shadow_engine import COVERAGE, TOKEN, ESeq, ShadowEngine




class StepDriver(ShadowEngine):
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
            # (never into a page a slide released: the manager refuses a dropped last page)
            floor = (max(s.dropped) + 1) * ps if s.dropped else 0
            if s.m_tokens >= floor + 2 and data.draw(st.integers(0, 7), label="truncate?") == 0:
                n = data.draw(st.integers(1, s.m_tokens - floor - 1), label="drop")
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

        slides = []
        for sid in running:   # a sliding window: pages before the window leave (checked after the commits)
            s = self.seqs[sid]
            committed = next((c.num_computed for c in commits if c.seq_id == sid), s.m_computed)
            cut = next((t.num_tokens for t in truncs if t.seq_id == sid), None)
            if cut is not None:
                committed = min(committed, s.m_tokens - cut)
            pages = committed // ps
            # As the engine slides: from a fixed first page (sinks kept before it) up to a window
            # boundary that only moves forward.
            start = s.slide_from if s.slide_from is not None else data.draw(st.integers(0, 1), label="sinks")
            first = max([start, *(i + 1 for i in s.dropped)])
            if pages > first and data.draw(st.integers(0, 5), label="slide?") == 0:
                end = data.draw(st.integers(first + 1, pages), label="slide end")
                slides.append(Slide(sid, first, end))
                s.slide_from = start
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
        req = StepRequest(self.epoch, releases, truncs, commits, needs, mode, slides)

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
        # plan.copies = truncation copies, then one copy per granted fork of a parent with a
        # partial page. A sequence preempted in the step has none: its pages, freed, may be a
        # later need's by the time the copies run.
        preempted_ids = {pre.seq_id for pre in plan.preempted}
        forks = [(need, res) for need, res in zip(needs, plan.results) if isinstance(need, Fork) and res.granted]
        fork_copies = [need for need, _ in forks if self.seqs[need.parent_seq_id].computed % ps]
        limit = len(plan.copies) - len(fork_copies)
        assert limit >= 0, f"plan has {len(plan.copies)} copies for {len(fork_copies)} forks"
        ci = 0
        for t in truncs:
            if t.seq_id not in preempted_ids:
                ci = self._claim_copy(self.seqs[t.seq_id], trunc_len[t.seq_id], plan.copies, ci, limit)
        assert ci == limit, f"copies {plan.copies[ci:limit]} belong to no truncation or fork"
        for need, (src, dst) in zip(fork_copies, plan.copies[limit:]):
            parent = self.seqs[need.parent_seq_id]
            assert src == parent.table[parent.computed // ps], (
                f"fork copy {src}->{dst} does not read the parent's partial page {parent.table}")
        for c in commits:
            self.seqs[c.seq_id].committed()
        for sl in slides:
            self.seqs[sl.seq_id].dropped.update(range(sl.first_page, sl.end_page))
            COVERAGE["slide"] += 1
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
                else:   # its device pages went to a Grow whose own sequence would have been the victim
                    COVERAGE["swapped, then recomputed"] += 1
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
