"""One test per rule of the manager (docs/architecture.md), each with a case that fails
if the rule is broken. Page and seq ids are exact: a fresh manager hands both
out FIFO from 0."""

from __future__ import annotations

import pytest

from kvserve.kvcache_service.core import (
    Admit,
    AlreadyExists,
    Commit,
    FailedPrecondition,
    Fork,
    Grow,
    InvalidArgument,
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

PS = 4


def make(num_pages=16, max_seqs=8, cpu_pages=16) -> KVCacheManager:
    return KVCacheManager(ManagerConfig(num_pages=num_pages, page_size=PS, max_seqs=max_seqs, cpu_pages=cpu_pages))


def admit(m, request_id, tokens, **kw):
    plan = m.step(StepRequest(needs=[Admit(request_id, tokens, **kw)]))
    (result,) = plan.results
    assert result.granted, result.reason
    return result


def admit_computed(m, request_id, tokens):
    """Admit and commit the whole prompt as computed."""
    r = admit(m, request_id, tokens)
    m.step(StepRequest(commits=[Commit(r.seq_id, len(tokens))]))
    return r


def test_identical_prompts_in_one_step_share_no_uncomputed_page():
    m = make()
    prompt = list(range(10))
    plan = m.step(StepRequest(needs=[Admit("a", prompt), Admit("b", prompt)]))
    a, b = plan.results
    assert (a.page_ids, b.page_ids) == ([0, 1, 2], [3, 4, 5])
    assert a.cached_tokens == b.cached_tokens == 0
    # Both commit; the second finds the first's pages in the tree and keeps its own private.
    m.step(StepRequest(commits=[Commit(a.seq_id, 10), Commit(b.seq_id, 10)]))
    assert m.state.tree.page_of == {h: p for h, p in zip(page_hashes(prompt, PS), [0, 1])}
    m.step(StepRequest(releases=[b.seq_id]))
    assert list(m.state.pool.free)[-3:] == [5, 4, 3]  # b's pages were all private: freed, tail first


def test_uncomputed_page_is_never_a_hit():
    m = make()
    prompt = list(range(12))
    first = admit(m, "a", prompt, max_tokens=8)  # chunk 1: pages 0, 1 allocated, not computed
    again = admit(m, "b", prompt)
    assert again.cached_tokens == 0
    m.step(StepRequest(commits=[Commit(first.seq_id, 8)]))  # now pages 0 and 1 are computed
    third = admit(m, "c", prompt)
    assert third.cached_tokens == 8
    assert third.page_ids[:2] == [0, 1]


def test_the_last_prompt_token_is_never_a_hit():
    m = make()
    prompt = list(range(8))  # exactly two full pages
    a = admit_computed(m, "a", prompt)
    m.step(StepRequest(releases=[a.seq_id]))
    b = admit(m, "b", prompt)
    assert b.cached_tokens == 4  # page 1 holds the last token: recomputed, not hit
    assert b.num_tokens == 4
    assert m.match_prefix(prompt)[0] == 8  # the read-only query still sees both pages


def test_skip_prefix_hits_computes_every_token_and_keeps_duplicates_private():
    m = make()
    prompt = list(range(12))
    a = admit_computed(m, "a", prompt)
    m.step(StepRequest(releases=[a.seq_id]))
    parked = m.state.tree.parked()
    b = admit(m, "b", prompt, skip_prefix_hits=True)
    assert b.cached_tokens == 0 and b.num_tokens == 12 and set(b.page_ids).isdisjoint(a.page_ids)
    assert m.state.tree.parked() == parked   # nothing it skipped was taken from the LRU
    m.step(StepRequest(commits=[Commit(b.seq_id, 12)]))
    assert m.state.tree.page_of == {h: p for h, p in zip(page_hashes(prompt, PS), a.page_ids)}
    m.step(StepRequest(releases=[b.seq_id]))   # its full pages duplicated a's: freed, not cached
    assert m.stats().cached_pages == 3
    assert admit(m, "c", prompt).cached_tokens == 8   # the page of the last token is never a hit


def test_release_keeps_full_computed_pages_cached_and_frees_partial():
    m = make()
    a = admit_computed(m, "a", list(range(10)))  # pages 0, 1 full; 2 partial
    freed, cached = m.release(a.seq_id)
    assert (freed, cached) == (1, 2)
    s = m.stats()
    assert (s.free_pages, s.cached_pages, s.used_pages) == (14, 2, 0)
    assert m.state.tree.parked() == [1, 0]  # parked tail first: the leaf is the oldest


def test_eviction_takes_lru_leaves_first():
    m = make(num_pages=6)
    a = admit_computed(m, "a", list(range(9)))       # pages 0, 1 full (chain 0 -> 1), 2 partial
    b = admit_computed(m, "b", [50 + t for t in range(5)])  # page 3 full, 4 partial
    m.step(StepRequest(releases=[a.seq_id]))        # parks 1 then 0
    m.step(StepRequest(releases=[b.seq_id]))        # parks 3
    assert m.state.tree.parked() == [1, 0, 3]
    assert list(m.state.pool.free) == [5, 2, 4]
    # Six pages wanted: the three free ones, then leaf 1, its parent 0, then 3.
    r = admit(m, "c", [90 + t for t in range(24)], max_tokens=20)
    assert r.page_ids == [5, 2, 4, 1, 0]
    assert m.state.tree.parked() == [3]
    assert m.stats().evictions == 2


def test_a_hit_refreshes_recency():
    m = make(num_pages=5)
    a = admit_computed(m, "a", list(range(5)))             # page 0 full, 1 partial
    b = admit_computed(m, "b", [50 + t for t in range(5)])  # page 2 full, 3 partial
    m.step(StepRequest(releases=[a.seq_id, b.seq_id]))     # parked: 0 then 2
    c = admit(m, "c", list(range(5)))                       # hits 0: referenced again
    m.step(StepRequest(releases=[c.seq_id]))               # 0 parks again, now newest
    assert m.state.tree.parked() == [2, 0]


def test_can_allocate_counts_parked_hits_as_unavailable():
    m = make(num_pages=4)
    a = admit_computed(m, "a", list(range(9)))  # pages 0, 1 cached, 2 partial
    m.step(StepRequest(releases=[a.seq_id]))
    # 12 tokens: hits pages 0 and 1 (parked), needs 1 new page. Free: 2 pages.
    check = m.can_allocate(Admit("b", list(range(12))))
    assert check.ok and check.pages_needed == 1 and check.pages_available == 2
    # A disjoint prompt of 4 pages would evict: 2 free + 2 parked = 4.
    assert m.can_allocate(Admit("c", [70 + t for t in range(16)])).ok
    # But a prompt hitting both parked pages and needing 3 more cannot have them.
    check = m.can_allocate(Admit("d", list(range(8)) + [80 + t for t in range(12)]))
    assert not check.ok and check.pages_needed == 3 and check.pages_available == 2
    before = m.stats()
    with pytest.raises(ResourceExhausted):
        m.try_allocate(Admit("d", list(range(8)) + [80 + t for t in range(12)]))
    assert m.stats() == before


def test_can_allocate_true_means_allocate_succeeds():
    m = make(num_pages=4)
    need = Admit("a", list(range(16)))
    assert m.can_allocate(need).ok
    before = m.stats()
    assert m.stats() == before  # the check changed nothing
    result, _, _ = m.allocate(need)   # the act alone: it trusts the check
    assert result.page_ids == [0, 1, 2, 3]


def test_fork_shares_full_pages_and_copies_only_the_partial_one():
    m = make()
    a = admit(m, "a", list(range(10)))
    m.step(StepRequest(commits=[Commit(a.seq_id, 10)]))
    plan = m.step(StepRequest(needs=[Fork(a.seq_id, "a/1")]))
    (child,) = plan.results
    assert child.page_ids == [0, 1, 3]
    assert plan.copies == [(2, 3)]
    assert m.state.pool.ref[0] == m.state.pool.ref[1] == 2 and m.state.pool.ref[2] == m.state.pool.ref[3] == 1
    # Forking at a page boundary copies nothing.
    b = admit(m, "b", [40 + t for t in range(8)])
    m.step(StepRequest(commits=[Commit(b.seq_id, 8)]))
    plan = m.step(StepRequest(needs=[Fork(b.seq_id, "b/1")]))
    assert plan.copies == [] and plan.results[0].page_ids == [4, 5]


def test_fork_gives_the_child_the_slots_it_asks_for():
    """Parallel sampling forks before the last prompt token: each child computes it in its own
    slot, which starts a page when the shared tokens end on a page boundary."""
    m = make()
    a = admit(m, "a", list(range(9)))             # page_size 4: pages 0, 1, 2
    m.step(StepRequest(commits=[Commit(a.seq_id, 8)]))
    plan = m.step(StepRequest(needs=[Fork(a.seq_id, "a/1", num_tokens=9)]))
    assert plan.copies == [] and plan.results[0].page_ids == [0, 1, 3]   # shared 0, 1; its own 3
    b = admit(m, "b", [40 + t for t in range(7)])  # pages 4, 5
    m.step(StepRequest(commits=[Commit(b.seq_id, 6)]))
    assert m.can_allocate(Fork(b.seq_id, "b/1", num_tokens=7)).pages_needed == 1
    plan = m.step(StepRequest(needs=[Fork(b.seq_id, "b/1", num_tokens=7)]))
    assert plan.copies == [(5, 6)] and plan.results[0].page_ids == [4, 6]   # the copy holds slot 6
    with pytest.raises(InvalidArgument, match="fewer than the 8 tokens"):
        m.step(StepRequest(needs=[Fork(a.seq_id, "a/2", num_tokens=5)]))


def test_truncate_frees_exactly_the_pages_past_the_new_end():
    m = make()
    a = admit(m, "a", list(range(13)))  # pages 0..3
    m.step(StepRequest(commits=[Commit(a.seq_id, 13, [99])]))  # 14 tokens known
    seq = m.state.seqs[a.seq_id]
    _, freed, copies = m.truncate(a.seq_id, 6)  # 8 tokens stay: pages 0, 1
    # Page 3 (private, partial) is freed; page 2 is full and computed: it stays cached.
    assert (freed, copies) == (1, [])
    assert seq.pages == [0, 1] and seq.tokens == list(range(8)) and seq.num_computed == 8
    assert list(m.state.pool.free)[-1] == 3 and m.state.tree.parked() == [2]
    # Truncating into a cached page copies it: the cached one is never overwritten.
    _, freed, copies = m.truncate(a.seq_id, 2)  # 6 tokens: page 1 (a tree node) becomes partial
    assert copies == [(1, 4)] and seq.pages == [0, 4]
    assert m.state.tree.is_node(1) and m.state.pool.ref[1] == 0


def test_swap_out_leaves_shared_pages_in_place_and_swap_in_dedups():
    m = make()
    a = admit(m, "a", list(range(10)))
    m.step(StepRequest(commits=[Commit(a.seq_id, 10)]))
    b = admit(m, "b", list(range(9)))  # shares page 0 and 1 (cached)... the last token is on page 2
    assert b.cached_tokens == 8 and b.page_ids == [0, 1, 3]
    copies = m.swap_out(a.seq_id)
    assert copies == [(2, 0)]  # only the private partial page; 0 and 1 are shared with b
    assert m.state.seqs[a.seq_id].pages == [0, 1, SWAPPED_OUT]
    result, copies, _ = m.try_allocate(Resume(a.seq_id))
    assert copies == [(0, 4)] and result.page_ids == [0, 1, 4]  # 4: the free list's head


def test_swap_in_shares_pages_that_stayed_cached():
    m = make()
    a = admit(m, "a", list(range(10)))
    m.step(StepRequest(commits=[Commit(a.seq_id, 10)]))
    assert m.swap_out(a.seq_id) == [(2, 0), (1, 1), (0, 2)]  # tail first
    assert m.state.tree.parked() == [1, 0]  # tree pages stay cached on the device while swapped
    result, copies, _ = m.try_allocate(Resume(a.seq_id))
    assert copies == [(0, 3)]  # only the private page comes back by copy
    assert result.page_ids == [0, 1, 3]


def test_swap_in_reinserts_evicted_pages_in_the_tree():
    m = make(num_pages=4)
    a = admit(m, "a", list(range(10)))
    m.step(StepRequest(commits=[Commit(a.seq_id, 10)]))
    m.swap_out(a.seq_id)
    admit(m, "x", [70 + t for t in range(16)])  # takes free page 3 and evicts 1, 0, 2
    assert len(m.state.tree) == 0
    m.step(StepRequest(releases=[1]))
    plan = m.step(StepRequest(needs=[Resume(a.seq_id)]))
    assert plan.results[0].granted
    assert sorted(plan.swap_in) == [(0, 1), (1, 0), (2, 2)] or len(plan.swap_in) == 3
    seq = m.state.seqs[a.seq_id]
    assert [m.state.tree.hash_of[p] for p in seq.pages[:2]] == page_hashes(list(range(10)), PS)


def test_preemption_takes_the_tail_of_the_running_order():
    m = make(num_pages=6, cpu_pages=0)
    ids = [admit(m, r, [i * 10 + t for t in range(8)]).seq_id for i, r in enumerate("abc")]
    m.step(StepRequest(commits=[Commit(s, 8) for s in ids]))
    plan = m.step(StepRequest(needs=[Grow(ids[0], 9)]))
    assert [p.seq_id for p in plan.preempted] == [ids[2]]
    assert plan.preempted[0].mode is PreemptionMode.RECOMPUTE
    assert plan.results[0].granted and plan.results[0].page_ids == [5]
    assert m.stats().preemptions_recompute == 1
    # c's pages were parked tail first, so a's growth evicted page 5; page 4 stays cached.
    assert m.state.tree.parked() == [4]
    assert m.match_prefix([20 + t for t in range(8)])[0] == 4


def test_a_sequence_at_the_tail_preempts_itself():
    m = make(num_pages=4, cpu_pages=0)
    a = admit(m, "a", list(range(8)))
    b = admit(m, "b", [50 + t for t in range(8)])
    m.step(StepRequest(commits=[Commit(a.seq_id, 8), Commit(b.seq_id, 8)]))
    plan = m.step(StepRequest(needs=[Grow(b.seq_id, 9)]))
    assert [p.seq_id for p in plan.preempted] == [b.seq_id]
    assert not plan.results[0].granted


def test_swap_preemption_moves_private_pages_and_falls_back_to_recompute():
    m = make(num_pages=6, cpu_pages=2)
    ids = [admit(m, r, [i * 10 + t for t in range(8)]).seq_id for i, r in enumerate("abc")]
    m.step(StepRequest(commits=[Commit(s, 8) for s in ids]))
    plan = m.step(StepRequest(needs=[Grow(ids[0], 9)], preemption_mode=PreemptionMode.SWAP))
    assert [(p.seq_id, p.mode) for p in plan.preempted] == [(ids[2], PreemptionMode.SWAP)]
    assert plan.swap_out == [(5, 0), (4, 1)]
    # The CPU pool is now full: the next victim is recomputed instead.
    plan = m.step(StepRequest(needs=[Grow(ids[0], 17)], preemption_mode=PreemptionMode.SWAP))
    assert [(p.seq_id, p.mode) for p in plan.preempted] == [(ids[1], PreemptionMode.RECOMPUTE)]


def test_victims_granted_earlier_in_the_step_lose_their_grant():
    m = make(num_pages=5, cpu_pages=0)
    a = admit(m, "a", list(range(8)))
    m.step(StepRequest(commits=[Commit(a.seq_id, 8)]))
    plan = m.step(StepRequest(needs=[Admit("b", [50, 51]), Grow(a.seq_id, 20)]))
    # b was admitted (1 page); a's growth needs 3 pages, 2 are left: b, the tail, is preempted.
    assert plan.results[1].granted
    assert [p.request_id for p in plan.preempted] == ["b"]
    assert not plan.results[0].granted and "preempted" in plan.results[0].reason


def test_refused_admission_blocks_later_ones():
    m = make(num_pages=4)
    plan = m.step(StepRequest(needs=[Admit("big", list(range(40))), Admit("small", [1, 2])]))
    assert [r.granted for r in plan.results] == [False, False]
    assert "earlier" in plan.results[1].reason


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_a_step_that_preempts_admits_and_resumes_nobody(mode):
    """The room a Grow's preemption frees goes to its victim first (back at the head of its queue
    at the next step), not to a younger request in the same step: that one overtook the victim,
    and, ahead of it in the running order, made it the next victim too."""
    m = make(num_pages=5, cpu_pages=8)
    a, b = (admit(m, r, [i * 10 + t for t in range(8)]).seq_id for i, r in enumerate("ab"))
    m.step(StepRequest(commits=[Commit(a, 8), Commit(b, 8)]))
    c = admit(m, "c", [90, 91, 92, 93]).seq_id   # a swapped-out sequence to resume below
    m.step(StepRequest(commits=[Commit(c, 4)]))
    m.step(StepRequest(needs=[Grow(a, 12)], preemption_mode=PreemptionMode.SWAP))   # c, the tail, swaps out
    assert m.sequence_info(c).state.name == "SWAPPED"
    plan = m.step(StepRequest(needs=[Grow(a, 16), Resume(c, 4), Admit("d", [1, 2])], preemption_mode=mode))
    assert [p.seq_id for p in plan.preempted] == [b] and plan.results[0].granted
    assert [r.granted for r in plan.results[1:]] == [False, False]
    assert all("preempted in this step" in r.reason for r in plan.results[1:])
    plan = m.step(StepRequest(needs=[Admit("d", [1, 2])]))   # without a preemption: admitted
    assert plan.results[0].granted


def test_seq_ids_are_reused_fifo_and_released_once():
    m = make(max_seqs=3)
    ids = [admit(m, r, [1, 2, 3]).seq_id for r in "abc"]
    assert ids == [0, 1, 2]
    m.release(1)
    with pytest.raises(NotFound):
        m.sequence_info(1)
    assert admit(m, "d", [1]).seq_id == 1
    m.release(0)
    m.release(2)
    assert m.state.seq_ids.free_ids() == [0, 2]


def test_a_pool_of_billions_of_seq_ids_costs_nothing_until_used():
    """--max-seqs up to 2^32-1 is accepted: its ids were a queue built at start (gigabytes)."""
    from kvserve.kvcache_service.core.seq_ids import SeqIdPool

    pool = SeqIdPool(2**32 - 1)
    assert len(pool) == 2**32 - 1
    a, b = pool.acquire(), pool.acquire()
    pool.release(a)
    assert (a, b, pool.acquire(), len(pool)) == (0, 1, 2, 2**32 - 3)
    small = SeqIdPool(3)
    ids = [small.acquire() for _ in range(3)]
    small.release(ids[1])
    small.release(ids[0])
    assert small.free_ids() == [1, 0] and small.acquire() == 1   # released ids, oldest first


def test_a_new_epoch_resets_and_a_stale_one_is_refused():
    m = make()
    assert m.register(7, PS, 16) is True
    plan = m.step(StepRequest(epoch=7, needs=[Admit("a", list(range(10)))]))
    m.step(StepRequest(epoch=7, commits=[Commit(plan.results[0].seq_id, 10)]))
    assert m.register(7, PS, 16) is False  # same epoch: nothing changes
    assert m.stats().num_sequences == 1
    assert m.register(8, PS, 16) is True
    s = m.stats()
    assert (s.num_sequences, s.used_pages, s.tree_pages, s.free_pages) == (0, 0, 0, 16)
    with pytest.raises(FailedPrecondition, match="stale epoch 7"):
        m.step(StepRequest(epoch=7))
    with pytest.raises(FailedPrecondition, match="epoch 9 was never registered: the manager is at epoch 8"):
        m.step(StepRequest(epoch=9))
    with pytest.raises(InvalidArgument, match="page_size 8 does not match the manager's 4"):
        m.register(9, 8, 16)


def test_an_epoch_far_ahead_of_the_clock_is_refused_so_a_restart_can_always_register():
    """Epochs are registration times: one a day ahead would outrank every model service started
    after it (each registers max(now, live + 1)), and no restart could serve again."""
    import time

    m = make()
    m.register(8, PS, 16)
    with pytest.raises(InvalidArgument, match="is more than a day ahead of this host's clock"):
        m.register(2**64 - 1, PS, 16)
    assert m.epoch == 8
    now = time.time_ns()
    assert m.register(now + 3600 * 10**9, PS, 16) is True        # an hour's skew is taken
    assert m.register(max(time.time_ns(), m.epoch + 1), PS, 16) is True   # and a restart still outranks it


def test_epochs_only_move_forward():
    """A stale model service (an older epoch) is refused and the live one's state is untouched."""
    m = make()
    m.register(8, PS, 16)
    a = m.step(StepRequest(epoch=8, needs=[Admit("a", list(range(10)))])).results[0]
    m.step(StepRequest(epoch=8, commits=[Commit(a.seq_id, 10)]))
    before = m.stats()
    with pytest.raises(FailedPrecondition, match="epoch 7 is older than the live epoch 8"):
        m.register(7, PS, 16)
    assert m.stats() == before and m.epoch == 8
    assert m.register(8, PS, 16) is False and m.stats() == before   # the live epoch again: idempotent
    m.step(StepRequest(epoch=8, releases=[a.seq_id]))                # still the live epoch's to use


def test_a_step_may_release_a_request_and_admit_its_id_again():
    """Validated against the state the needs will meet: the release runs first."""
    m = make()
    a = admit_computed(m, "a", list(range(9)))
    plan = m.step(StepRequest(releases=[a.seq_id], needs=[Admit("a", list(range(9)))]))
    (again,) = plan.results
    assert again.granted and again.cached_tokens == 8   # its own pages, cached by the release
    assert m.state.by_request == {"a": again.seq_id}
    with pytest.raises(AlreadyExists):                  # without the release it is still live
        m.step(StepRequest(needs=[Admit("a", [1, 2])]))


def test_bad_step_changes_nothing():
    m = make()
    a = admit(m, "a", list(range(6)))
    before = (m.stats(), list(m.state.seqs[a.seq_id].pages), list(m.state.pool.free))
    bad = [
        StepRequest(releases=[a.seq_id], needs=[Grow(99, 4)]),                    # unknown seq
        StepRequest(releases=[a.seq_id, a.seq_id]),                               # released twice
        StepRequest(needs=[Admit("b", [1]), Admit("b", [2])]),                    # duplicate request id
        StepRequest(needs=[Admit("a", [1])]),                                     # live request id
        StepRequest(needs=[Admit("c", [])]),                                      # empty prompt
        StepRequest(needs=[Admit("c", [1], max_tokens=0)]),
        StepRequest(needs=[Admit("c", [-1])]),
        StepRequest(commits=[Commit(a.seq_id, 9)]),                               # beyond known tokens
        StepRequest(needs=[Grow(a.seq_id, 0)]),
        StepRequest(truncations=[Truncation(a.seq_id, 6)]),                       # would drop every token
        StepRequest(needs=[Admit("d", [1])], releases=[a.seq_id], commits=[Commit(a.seq_id, 1)]),
    ]
    errors = (InvalidArgument, NotFound, AlreadyExists)
    for request in bad:
        with pytest.raises(errors):
            m.step(request)
        assert (m.stats(), list(m.state.seqs[a.seq_id].pages), list(m.state.pool.free)) == before, request


def test_swapped_sequences_refuse_grow_and_commit():
    m = make()
    a = admit(m, "a", list(range(6)))
    m.swap_out(a.seq_id)
    with pytest.raises(FailedPrecondition):
        m.step(StepRequest(needs=[Grow(a.seq_id, 12)]))
    with pytest.raises(FailedPrecondition):
        m.commit(Commit(a.seq_id, 6))


def test_generated_tokens_are_cached_for_the_next_turn():
    m = make()
    a = admit(m, "a", list(range(6)))
    m.step(StepRequest(commits=[Commit(a.seq_id, 6, [100])]))
    m.step(StepRequest(commits=[Commit(a.seq_id, 7, [101])], needs=[Grow(a.seq_id, 8)]))
    m.step(StepRequest(commits=[Commit(a.seq_id, 8, [102])], needs=[Grow(a.seq_id, 9)]))
    m.step(StepRequest(releases=[a.seq_id]))
    turn2 = list(range(6)) + [100, 101, 102, 7, 8]
    assert admit(m, "b", turn2).cached_tokens == 8


def test_extra_key_separates_caches():
    m = make()
    a = admit_computed(m, "a", list(range(9)))
    m.step(StepRequest(releases=[a.seq_id]))
    assert admit(m, "b", list(range(9)), extra_key="tenant-2").cached_tokens == 0
    assert admit(m, "c", list(range(9))).cached_tokens == 8


def test_a_resume_undone_in_the_same_step_publishes_nothing():
    m = make(num_pages=6, cpu_pages=8)
    prompt = list(range(9))
    a = admit(m, "a", prompt)                                  # pages 0, 1, 2
    m.step(StepRequest(commits=[Commit(a.seq_id, 9)]))        # 0, 1 enter the tree
    m.swap_out(a.seq_id)
    b = admit(m, "b", [50 + t for t in range(24)])             # takes 3, 4, 5, 2 and evicts 1, 0
    assert len(m.state.tree) == 0
    m.step(StepRequest(commits=[Commit(b.seq_id, 24)]))
    m.step(StepRequest(releases=[b.seq_id]))                   # b's 6 pages all parked
    # a resumes (3 pages, copied back) and is then the tail when c's growth needs every page.
    c = admit(m, "c", [90, 91, 92])
    plan = m.step(StepRequest(needs=[Resume(a.seq_id), Grow(c.seq_id, 16)]))
    assert [(p.seq_id, p.mode) for p in plan.preempted] == [(a.seq_id, PreemptionMode.RECOMPUTE)]
    assert plan.swap_in == []  # its copies would land in pages that are no longer its own
    hashes = page_hashes(prompt, PS)
    assert all(m.state.tree.get(h) is None for h in hashes), "a page whose bytes never arrived is in the tree"
