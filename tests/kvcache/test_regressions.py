"""Reproductions of core bugs the state machine (or reading the core) found."""

from __future__ import annotations

import pytest

from kvserve.kvcache_service.core import (
    Admit,
    Commit,
    Fork,
    Grow,
    InvalidArgument,
    KVCacheManager,
    ManagerConfig,
    PreemptionMode,
    ResourceExhausted,
    Resume,
    StepRequest,
    Truncation,
    page_hashes,
)
from tests.kvcache.invariants import check_invariants, snapshot


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


def test_a_truncations_copy_frees_its_old_last_page_for_the_next_truncation():
    """A copy takes the old last page's place, whose reference then goes: room for the next
    truncation's copy in the same Step (validation left it out, and refused what fits)."""
    m = KVCacheManager(ManagerConfig(num_pages=6, page_size=4, max_seqs=4))
    (x,) = m.step(StepRequest(needs=[Admit("x", list(range(12)))])).results    # 3 pages
    (y,) = m.step(StepRequest(needs=[Admit("y", list(range(50, 58)))])).results  # 2 pages
    m.step(StepRequest(commits=[Commit(x.seq_id, 12), Commit(y.seq_id, 8)]))     # all full: tree nodes
    m.step(StepRequest(needs=[Admit("f", [99])]))                                 # the last page
    assert m.state.available() == 0
    # x down to 7 tokens: its page 2 parks (room for the copy of page 1), then page 1 parks too;
    # y down to 6 tokens: the copy of its page 1 takes that room
    plan = m.step(StepRequest(truncations=[Truncation(x.seq_id, 5), Truncation(y.seq_id, 2)]))
    assert len(plan.copies) == 2
    check_invariants(m.state)


def test_a_fork_counts_its_parents_tokens_as_the_steps_truncation_leaves_them():
    """Validated against the parent's computed tokens from before the Step's truncation, a Fork
    asking slots for the truncated length was refused INVALID_ARGUMENT (a resync for an engine)."""
    from kvserve.kvcache_service.core import Fork
    m = KVCacheManager(ManagerConfig(num_pages=16, page_size=4, max_seqs=4))
    (a,) = m.step(StepRequest(needs=[Admit("a", list(range(10)))])).results
    m.step(StepRequest(commits=[Commit(a.seq_id, 10)]))
    plan = m.step(StepRequest(truncations=[Truncation(a.seq_id, 4)], needs=[Fork(a.seq_id, "child", num_tokens=6)]))
    assert plan.results[0].granted
    check_invariants(m.state)
    with pytest.raises(InvalidArgument, match="num_tokens 5 is fewer than the 6 tokens the child shares"):
        m.step(StepRequest(needs=[Fork(a.seq_id, "other", num_tokens=5)]))   # a has 6 computed now


def _forked_pair(m: KVCacheManager, first: str = "A") -> tuple[int, int]:
    """A committed two-page sequence and a fork of it: every page of the fork is shared."""
    a = m.step(StepRequest(needs=[Admit(first, list(range(8)))])).results[0].seq_id
    m.step(StepRequest(commits=[Commit(a, 8)]))
    b = m.step(StepRequest(needs=[Fork(a, first + "-fork")])).results[0].seq_id
    return a, b


def _swapped_fork_of_a_released_parent(m: KVCacheManager, first: str) -> int:
    """A fork that swapped its own page out and keeps on the device the two tree pages it shares
    with its parent, which is gone: no running sequence holds them, and they are not evictable."""
    parent = m.step(StepRequest(needs=[Admit(first, [ord(first)] * 8)])).results[0].seq_id
    m.step(StepRequest(commits=[Commit(parent, 8)]))
    child = m.step(StepRequest(needs=[Fork(parent, first + "-fork")])).results[0].seq_id
    m.step(StepRequest(needs=[Grow(child, 12)]))   # a page of its own, to move
    m.swap_out(child)
    m.step(StepRequest(releases=[parent]))
    return child


def _modes(plan) -> dict[int, PreemptionMode]:
    return {p.seq_id: p.mode for p in plan.preempted}


def test_a_grow_takes_back_the_device_pages_of_swapped_sequences_before_preempting_itself():
    """A Grow short only of the pages swapped sequences keep on the device (shared pages; a slid
    sequence's tree pages) preempted its own sequence, which lost its work while they kept
    theirs: with sliding windows the two took turns for ever. Now they go back to be
    recomputed, earliest swapped first, only as many as it takes; one that keeps no device page
    is left alone."""
    m = KVCacheManager(ManagerConfig(num_pages=10, page_size=4, max_seqs=8, cpu_pages=8))
    first = _swapped_fork_of_a_released_parent(m, "P")
    second = _swapped_fork_of_a_released_parent(m, "Q")
    alone = m.step(StepRequest(needs=[Admit("N", [200] * 6)])).results[0].seq_id   # two private pages
    m.swap_out(alone)                                                               # both moved
    g = m.step(StepRequest(needs=[Admit("G", [100] * 4)])).results[0].seq_id
    assert m.stats().free_pages == 5   # 10 less the forks' four less G's one
    plan = m.step(StepRequest(needs=[Grow(g, 28), Resume(first, 12)], preemption_mode=PreemptionMode.SWAP))
    assert plan.results[0].granted, plan.results[0].reason
    assert _modes(plan) == {first: PreemptionMode.RECOMPUTE}   # its two pages were enough
    assert not plan.results[1].granted   # the step preempted: nobody resumes
    assert {first} & set(m.state.seqs) == set() and {second, alone} <= m.state.swapped.keys()
    stats = m.stats()
    assert (stats.num_swapped, stats.preemptions_recompute, stats.cpu_free_pages) == (2, 1, 8 - 1 - 2)
    check_invariants(m.state)


def test_a_grow_that_swapped_sequences_cannot_make_fit_preempts_itself_and_leaves_them_alone():
    """Taking back what swapped sequences keep only makes sense when it is enough: otherwise the
    Grow's own sequence is the victim, as before, and they lose nothing."""
    m = KVCacheManager(ManagerConfig(num_pages=10, page_size=4, max_seqs=8, cpu_pages=8))
    older = m.step(StepRequest(needs=[Admit("O", [300] * 12)])).results[0].seq_id   # three pages, running
    child = _swapped_fork_of_a_released_parent(m, "P")
    g = m.step(StepRequest(needs=[Admit("G", [100] * 4)])).results[0].seq_id
    plan = m.step(StepRequest(needs=[Grow(g, 28)]))   # six more: four free, and the fork's two
    assert plan.results[0].granted   # (O is older: it keeps running)
    assert _modes(plan) == {child: PreemptionMode.RECOMPUTE}
    m2 = KVCacheManager(ManagerConfig(num_pages=10, page_size=4, max_seqs=8, cpu_pages=8))
    older = m2.step(StepRequest(needs=[Admit("O", [300] * 12)])).results[0].seq_id
    child = _swapped_fork_of_a_released_parent(m2, "P")
    g = m2.step(StepRequest(needs=[Admit("G", [100] * 4)])).results[0].seq_id
    before = m2.state.seqs[child].pages[:]
    plan = m2.step(StepRequest(needs=[Grow(g, 32)]))   # seven more: the fork's two are not enough
    assert not plan.results[0].granted and "could never fit" not in plan.results[0].reason
    assert _modes(plan) == {g: PreemptionMode.RECOMPUTE}
    assert m2.state.seqs[child].pages == before and child in m2.state.swapped and older in m2.state.running
    check_invariants(m2.state)


def test_a_sequence_swapped_in_the_step_that_takes_back_its_pages_is_one_recompute():
    """The tail swapped first keeps the pages it shares with a swapped sibling; then both go back
    to be recomputed. The victim is listed once, as a recompute, with no swap-out copy left (its
    CPU pages are free again)."""
    m = KVCacheManager(ManagerConfig(num_pages=8, page_size=4, max_seqs=8, cpu_pages=8))
    g = m.step(StepRequest(needs=[Admit("G", [100] * 4)])).results[0].seq_id
    parent, first = _forked_pair(m, "P")
    m.step(StepRequest(needs=[Grow(first, 12)]))
    m.swap_out(first)
    second = m.step(StepRequest(needs=[Fork(parent, "P-fork-2")])).results[0].seq_id
    m.step(StepRequest(needs=[Grow(second, 12)], releases=[parent]))
    # G 1 page, the shared 2, second's own 1: 4 free. Six more for G: second swaps its own page out
    # (5 free), then the shared pages, held only by the two swapped forks, make it 7.
    plan = m.step(StepRequest(needs=[Grow(g, 28)], preemption_mode=PreemptionMode.SWAP))
    assert plan.results[0].granted, plan.results[0].reason
    assert sorted((p.seq_id, p.mode.name) for p in plan.preempted) == sorted(
        [(second, "RECOMPUTE"), (first, "RECOMPUTE")])
    assert plan.swap_out == []
    stats = m.stats()
    assert (stats.num_swapped, stats.preemptions_swap, stats.cpu_free_pages, stats.num_sequences) == (0, 0, 8, 1)
    check_invariants(m.state)


@pytest.mark.parametrize("cpu_pages", [8, 0])
def test_a_swap_that_would_move_nothing_is_a_recompute(cpu_pages):
    """A fork whose pages are all shared frees nothing when swapped (it keeps them), and with no
    CPU pages swapping is off: both were "swapped", the Grow was refused with room to spare."""
    m = KVCacheManager(ManagerConfig(num_pages=8, page_size=4, max_seqs=8, cpu_pages=cpu_pages))
    g = m.step(StepRequest(needs=[Admit("G", [100] * 4)])).results[0].seq_id
    a, b = _forked_pair(m)
    plan = m.step(StepRequest(needs=[Grow(g, 28)], preemption_mode=PreemptionMode.SWAP))
    assert plan.results[0].granted
    modes = {p.seq_id: p.mode for p in plan.preempted}
    assert modes[b] is PreemptionMode.RECOMPUTE   # nothing of its own to move
    assert modes[a] is (PreemptionMode.SWAP if cpu_pages else PreemptionMode.RECOMPUTE)
    assert m.stats().num_swapped == (1 if cpu_pages else 0)
    check_invariants(m.state)
    fork = m.step(StepRequest(needs=[Fork(g, "g-fork")])).results[0].seq_id
    if not cpu_pages:
        with pytest.raises(ResourceExhausted, match="no CPU pages \\(--cpu-pages 0\\): swapping is off"):
            m.swap_out(fork)
    else:   # the call, as the Step: it marked the fork swapped and freed nothing
        before = snapshot(m.state)
        with pytest.raises(ResourceExhausted, match="every page it holds is shared, so a swap would free nothing"):
            m.swap_out(fork)
        assert snapshot(m.state) == before


def test_a_step_of_more_needs_than_any_engine_sends_is_refused_whole_and_changes_nothing():
    """Its answer (a refusal per admission) outgrew gRPC's message limit after it was applied.
    Admissions past the seq-id pool are still refused one by one: an engine may run more
    sequences at once than a manager's --max-seqs."""
    from kvserve.kvcache_service.core.validation import MAX_NEEDS
    m = KVCacheManager(ManagerConfig(num_pages=16, page_size=4, max_seqs=4))
    before = snapshot(m.state)
    with pytest.raises(InvalidArgument, match=f"step: {MAX_NEEDS + 1:,} needs, more than the {MAX_NEEDS:,} a Step"):
        m.step(StepRequest(needs=[Admit(f"r{i}", [1]) for i in range(MAX_NEEDS + 1)]))
    assert snapshot(m.state) == before
    plan = m.step(StepRequest(needs=[Admit(f"r{i}", [1]) for i in range(16)]))   # twelve past the pool
    assert [r.granted for r in plan.results] == [True] * 4 + [False] * 12


def test_a_grow_past_the_pool_is_refused_without_walking_every_sequences_pages(monkeypatch):
    """With a page blocked by a slide, a Grow that does not fit works out the room page by page
    over every other sequence's table; one asking for more than the pool less its own pages
    cannot fit whatever that walk says, and is refused before it (a Step of such Grows over
    many forks of a long table took seconds)."""
    from kvserve.kvcache_service.contract.types import Slide
    from kvserve.kvcache_service.core import release
    m = KVCacheManager(ManagerConfig(num_pages=16, page_size=4, max_seqs=8))
    res, _, _ = m.try_allocate(Admit("a", list(range(1, 41))))   # 10 pages
    sid = res.seq_id
    m.commit(Commit(sid, 40))
    m.step(StepRequest(slides=[Slide(sid, 0, 1)]))   # page 0 parks blocked by page 1
    assert m.state.tree.num_parked > m.state.tree.num_evictable
    forks = [m.try_allocate(Fork(sid, f"c{i}"))[0].seq_id for i in range(3)]

    def walked(*_):
        raise AssertionError("the room was worked out page by page")
    monkeypatch.setattr(release.DropForecast, "drop", walked)
    plan = m.step(StepRequest(needs=[Grow(s, 2**32 - 1) for s in [sid, *forks]]))
    assert not any(r.granted for r in plan.results) and "at most" in plan.results[0].reason
    check_invariants(m.state)


def test_a_commit_of_more_tokens_than_its_slots_and_the_pool_could_hold_is_refused():
    """Tokens past a sequence's slots are the few sampled ahead of them; millions more would
    only cost memory, and every fork a copy of them."""
    m = KVCacheManager(ManagerConfig(num_pages=8, page_size=4, max_seqs=4))
    res, _, _ = m.try_allocate(Admit("a", [1, 2, 3, 4]))   # one page: 4 slots, the pool 32 more
    sid = res.seq_id
    before = snapshot(m.state)
    with pytest.raises(InvalidArgument, match="the whole pool holds could ever compute"):
        m.commit(Commit(sid, 4, [7] * 33))
    assert snapshot(m.state) == before
    m.commit(Commit(sid, 4, [7] * 32))   # as far as the pool could still take it
    check_invariants(m.state)


def test_a_fork_preempted_in_its_step_leaves_no_copy_behind():
    """A fork's copy-on-write copy stayed in the plan after a Grow later in the step preempted the
    fork: its destination page, freed, went to the next fork's copy, and a page written twice
    in one batched copy holds either (found reading the core)."""
    m = KVCacheManager(ManagerConfig(num_pages=10, page_size=4, max_seqs=8))

    def admitted(tokens):
        sid = m.step(StepRequest(needs=[Admit(f"r{tokens[0]}", tokens)])).results[0].seq_id
        m.commit(Commit(sid, len(tokens)))
        return sid

    a, b, g = admitted([1, 2, 3, 4, 5]), admitted([9, 9, 9, 9, 8, 8]), admitted([7, 7, 7])
    plan = m.step(StepRequest(needs=[Fork(a, "c1", num_tokens=24), Grow(g, 20), Fork(b, "c2")]))
    c1, grown, c2 = plan.results
    assert [p.request_id for p in plan.preempted] == ["c1"] and not c1.granted and grown.granted and c2.granted
    assert len(plan.copies) == 1   # c2's only
    src, dst = plan.copies[0]
    assert src == m.state.seqs[b].pages[-1] and dst == m.state.seqs[c2.seq_id].pages[-1]
    check_invariants(m.state)


def test_an_extra_key_that_is_not_text_is_refused_before_the_step_changes_anything():
    """An in-process caller's lone surrogate (a --cache-salt from a command line's bytes that are
    not UTF-8) passed every check, then failed the hashing halfway through a Step: the Step's
    release had happened and a commit's tokens were moved."""
    m = KVCacheManager(ManagerConfig(num_pages=8, page_size=4, max_seqs=4))
    a = m.step(StepRequest(needs=[Admit("a", [1, 2, 3, 4])])).results[0].seq_id
    before = snapshot(m.state)
    with pytest.raises(InvalidArgument, match="extra_key is not Unicode text"):
        m.step(StepRequest(releases=[a], needs=[Admit("b", [1, 2, 3], extra_key="\ud800")]))
    assert snapshot(m.state) == before
    with pytest.raises(InvalidArgument, match="extra_key is not Unicode text"):
        m.match_prefix([1, 2, 3, 4], extra_key="salt\udcff")
    from kvserve.kvcache_service.contract.hashing import check_cache_salt, check_deployment_salt
    for check in (check_deployment_salt, check_cache_salt):
        with pytest.raises(ValueError, match="is not Unicode text"):
            check("\udcff")


def test_a_swapped_sequence_whose_pages_a_running_one_shares_is_not_recomputed_for_nothing():
    """A swapped fork keeps on the device only the pages it shares with its running parent:
    releasing it frees nothing. It was recomputed anyway, being swapped first, beside the one
    whose pages made the Grow fit; and the recomputed went after the step's running victims in
    the plan, which the engine reads lowest priority first, so they came back before them."""
    m = KVCacheManager(ManagerConfig(num_pages=12, page_size=4, max_seqs=8, cpu_pages=8))
    g = m.step(StepRequest(needs=[Admit("G", [100] * 8)])).results[0].seq_id
    m.step(StepRequest(commits=[Commit(g, 8)]))
    shares = m.step(StepRequest(needs=[Fork(g, "G-fork")])).results[0].seq_id
    m.step(StepRequest(needs=[Grow(shares, 12)]))
    m.swap_out(shares)                                     # swapped first; keeps G's two pages
    keeps = _swapped_fork_of_a_released_parent(m, "P")     # swapped second; keeps two of its own
    h = m.step(StepRequest(needs=[Admit("H", [101] * 4)])).results[0].seq_id   # the tail, running
    stats = m.stats()
    assert stats.free_pages + stats.cached_pages == 7   # 12 less G's 2, P-fork's 2 and H's 1
    # G wants 10 pages more: the 7, H's 1 (H is swapped), then P-fork's 2 (G's own 2 are the fork's too)
    plan = m.step(StepRequest(needs=[Grow(g, 48)], preemption_mode=PreemptionMode.SWAP))
    assert plan.results[0].granted, plan.results[0].reason
    assert [(p.seq_id, p.mode) for p in plan.preempted] == [(keeps, PreemptionMode.RECOMPUTE),
                                                             (h, PreemptionMode.SWAP)]
    assert shares in m.state.swapped and h in m.state.swapped
    check_invariants(m.state)


def test_the_swapped_sequences_two_grows_send_back_stay_lowest_priority_first_in_the_plan():
    """The engine reads a plan's victims lowest priority first. A second Grow of the step put the
    swapped sequence it sent back ahead of the one the first Grow had, which was swapped earlier."""
    m = KVCacheManager(ManagerConfig(num_pages=10, page_size=4, max_seqs=8, cpu_pages=8))
    first = _swapped_fork_of_a_released_parent(m, "A")
    second = _swapped_fork_of_a_released_parent(m, "B")
    g1 = m.step(StepRequest(needs=[Admit("G1", [100] * 4)])).results[0].seq_id
    g2 = m.step(StepRequest(needs=[Admit("G2", [101] * 4)])).results[0].seq_id
    # G2, the tail, takes the 4 free pages and A's 2; then G1 takes what G2 frees and B's 2
    plan = m.step(StepRequest(needs=[Grow(g2, 28), Grow(g1, 40)]))
    assert [r.granted for r in plan.results] == [False, True], plan.results
    assert [(p.seq_id, p.mode) for p in plan.preempted] == [
        (first, PreemptionMode.RECOMPUTE), (second, PreemptionMode.RECOMPUTE), (g2, PreemptionMode.RECOMPUTE)]
    check_invariants(m.state)


def test_of_two_swapped_sequences_sharing_pages_only_the_one_that_makes_room_is_recomputed():
    """S1 and S2 share a prompt's two pages, which only they hold; S2 alone keeps a third page.
    A Grow one page short recomputed S1 (swapped first), which freed nothing while S2 held the
    shared pages, and then S2: S1 lost its work for nothing."""
    m = KVCacheManager(ManagerConfig(num_pages=9, page_size=4, max_seqs=8, cpu_pages=8))

    def step(**kw):
        return m.step(StepRequest(**kw))

    p1 = step(needs=[Admit("P1", [7] * 8)]).results[0].seq_id            # the shared two pages
    step(commits=[Commit(p1, 8)])
    p2 = step(needs=[Fork(p1, "P2")]).results[0].seq_id
    step(needs=[Grow(p2, 12)])
    step(commits=[Commit(p2, 12, [9] * 4)])                                # and a third, P2's
    s1 = step(needs=[Fork(p1, "S1")]).results[0].seq_id
    step(needs=[Grow(s1, 12)])
    s2 = step(needs=[Fork(p2, "S2")]).results[0].seq_id
    step(needs=[Grow(s2, 16)])
    m.swap_out(s1)                     # keeps the shared two
    m.swap_out(s2)                     # keeps the shared two and the third
    step(releases=[p1, p2])
    g = step(needs=[Admit("G", [100] * 4)]).results[0].seq_id
    stats = m.stats()
    plan = step(needs=[Grow(g, 4 * (2 + stats.free_pages + stats.cached_pages))])   # one page past them
    assert plan.results[0].granted, plan.results[0].reason
    assert [(p.seq_id, p.mode) for p in plan.preempted] == [(s2, PreemptionMode.RECOMPUTE)]
    assert s1 in m.state.swapped
    check_invariants(m.state)
