"""A randomized engine drives a small KVCacheManager; every rule is followed by
check_invariants and by a shadow check of page CONTENTS (shadow_engine.py).

The machine plays the model service: Step as an engine drives it (step_driver.py), the
fine-grained calls one by one, re-registration, and bad inputs (bad_inputs.py), each with the
manager's answer checked against what an engine would expect.
"""

from __future__ import annotations

import os

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
    Fork,
    Grow,
    ManagerConfig,
    ResourceExhausted,
    Resume,
)
from kvserve.kvcache_service.core.sequence import table_view
from tests.kvcache.bad_inputs import BAD_INPUTS, bad_call, expect_refusal, targets_for
from tests.kvcache.invariants import check_invariants, snapshot
from tests.kvcache.shadow_engine import COVERAGE, TOKEN
from tests.kvcache.step_driver import StepDriver


class KVCacheMachine(StepDriver, RuleBasedStateMachine):

    @initialize(
        num_pages=st.integers(6, 24), page_size=st.sampled_from([2, 4]), max_seqs=st.integers(4, 8),
        cpu_pages=st.integers(0, 16),
        prefixes=st.lists(st.lists(TOKEN, max_size=10), min_size=1, max_size=3),
    )
    def setup(self, num_pages, page_size, max_seqs, cpu_pages, prefixes):
        self.start(ManagerConfig(num_pages=num_pages, page_size=page_size, max_seqs=max_seqs,
                                 cpu_pages=cpu_pages), prefixes)

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

    # ------------------------------------------------- fine-grained calls

    @rule(data=st.data())
    def allocate_admit(self, data):
        m, ps = self.m, self.ps
        self._free_a_seq_id(data)
        prompt, ek = self._draw_prompt(data)
        skip = data.draw(st.booleans(), label="skip prefix hits?")
        need = Admit(self._rid(), prompt, ek, self._draw_max_tokens(data), skip)
        matched, _ = m.match_prefix(prompt, ek)
        expect_cached = 0 if skip else min(matched, (len(prompt) - 1) // ps * ps)
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
        floor = (max(s.dropped) + 1) * self.ps if s.dropped else 0   # never into pages a slide released
        if len(s.tokens) - floor < 2:
            return
        n = data.draw(st.integers(1, len(s.tokens) - floor - 1), label="drop")
        before = snapshot(self.m.state)
        try:
            table, freed, copies = self.m.truncate(s.seq_id, n)
        except ResourceExhausted:
            assert snapshot(self.m.state) == before, "a refused truncation changed the state"
            return
        new_len = self._truncated(s, n)
        assert table == table_view(self.m.state.seqs[s.seq_id].pages)   # a slide's slots read 0
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
        private = [p for p in seq.pages if p >= 0 and m.state.pool.ref[p] == 1]
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
        kinds = [k for k, need in BAD_INPUTS.items() if targets_for(m, need)]
        kind = data.draw(st.sampled_from(kinds), label="bad input")
        targets = targets_for(m, BAD_INPUTS[kind])
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
        if hasattr(self, "m"):
            self.check_consistent()


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
