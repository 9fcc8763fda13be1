"""Slide: pages outside a sequence's attention window leave it while it runs (sliding-window
models). Ids are exact: a fresh manager hands out page ids FIFO from 0; page_size 4."""

from __future__ import annotations

import pytest

from kvserve.kvcache_service.core import (
    Admit,
    ResourceExhausted,
    Resume,
    Truncation,
    Commit,
    Fork,
    Grow,
    InvalidArgument,
    KVCacheManager,
    ManagerConfig,
    PreemptionMode,
    Slide,
    StepRequest,
)
from kvserve.kvcache_service.core.sequence import DROPPED
from tests.kvcache.invariants import check_invariants, snapshot

PS = 4


def make(num_pages=16) -> KVCacheManager:
    return KVCacheManager(ManagerConfig(num_pages=num_pages, page_size=PS, max_seqs=8, cpu_pages=16))


def step(m, **kw):
    plan = m.step(StepRequest(**kw))
    check_invariants(m.state)
    return plan


def running(m, request_id, tokens):
    (r,) = step(m, needs=[Admit(request_id, tokens)]).results
    assert r.granted
    step(m, commits=[Commit(r.seq_id, len(tokens))])
    return r.seq_id


def test_a_slide_frees_private_pages_and_keeps_tree_pages_cached_but_blocked():
    m = make()
    sid = running(m, "a", list(range(24)))            # pages 0..5, all full: tree nodes
    seq = m.state.seqs[sid]
    step(m, slides=[Slide(sid, 0, 3)])
    assert seq.pages[:3] == [DROPPED] * 3 and seq.slid
    # Pages 0..2 are cached (a prompt sharing them still hits) but blocked: the sequence holds
    # their children 3..5, so they are not evictable and not available.
    assert m.stats().used_pages == 6 and m.stats().cached_pages == 0   # cached counts the evictable
    assert m.state.available() == 16 - 6
    (hit,) = step(m, needs=[Admit("b", list(range(13)))]).results
    assert hit.cached_tokens == 12 and hit.page_ids[:3] == [0, 1, 2]
    # Once the sequence drops its last tree page, they become evictable, children first.
    step(m, slides=[Slide(sid, 3, 6)])
    step(m, releases=[hit.seq_id])
    ev = m.state.tree.evictable()
    assert set(ev) == set(range(6)) and all(ev.index(p + 1) < ev.index(p) for p in range(5))   # leaves first
    assert m.state.available() == 16 and m.state.seqs[sid].held() == []


def test_a_slid_sequence_stores_nothing_more_in_the_tree():
    m = make()
    sid = running(m, "a", list(range(10)))             # pages 0, 1 full (nodes), 2 partial
    step(m, slides=[Slide(sid, 0, 1)])
    step(m, needs=[Grow(sid, 16)])
    step(m, commits=[Commit(sid, 16, list(range(10, 16)))])
    assert len(m.state.tree) == 2                       # pages 2 and 3 filled, not stored
    step(m, slides=[Slide(sid, 1, 3)])
    seq = m.state.seqs[sid]
    assert seq.held() == [seq.pages[3]] and not any(m.state.tree.live_below)


def test_after_a_prefix_hit_the_commit_beside_the_first_slide_stores_nothing():
    """The chunk after a prefix hit as long as a window is committed in the step that first
    slides: stored, it lengthened the cached chain by a chunk at each reuse (each page of it
    blocked by the sequence's own), until a request that fits the model length could no longer
    find the pages; that slide applies before the commit beside it."""
    m = make()
    first = running(m, "a", list(range(8)))             # pages 0, 1 stored
    step(m, releases=[first])
    (hit,) = step(m, needs=[Admit("b", list(range(16)))]).results
    assert hit.cached_tokens == 8
    step(m, commits=[Commit(hit.seq_id, 16)], slides=[Slide(hit.seq_id, 0, 2)])
    assert len(m.state.tree) == 2                       # its pages 2, 3 stay private


def test_without_a_hit_the_commit_beside_the_first_slide_is_stored():
    """A first chunk longer than the window: its commit comes with the first slide, and is what
    a later request with the same prompt hits."""
    m = make()
    (a,) = step(m, needs=[Admit("a", list(range(16)))]).results
    step(m, commits=[Commit(a.seq_id, 16)], slides=[Slide(a.seq_id, 0, 2)])
    assert len(m.state.tree) == 4
    step(m, releases=[a.seq_id])
    (hit,) = step(m, needs=[Admit("b", list(range(17)))]).results
    assert hit.cached_tokens == 16


def test_slides_are_checked():
    m = make()
    sid = running(m, "a", list(range(10)))
    for slide, words in [(Slide(sid, 0, 3), "not computed"), (Slide(sid, 2, 2), "non-empty"),
                         (Slide(99, 0, 1), "99")]:
        with pytest.raises(Exception, match=words):
            m.step(StepRequest(slides=[slide]))
    with pytest.raises(InvalidArgument, match="slides twice"):
        m.step(StepRequest(slides=[Slide(sid, 0, 1), Slide(sid, 1, 2)]))
    # A commit in the same Step counts: its computed tokens are what the slide is checked against.
    step(m, needs=[Grow(sid, 12)])
    step(m, commits=[Commit(sid, 12, [10, 11])], slides=[Slide(sid, 0, 3)])


def test_sinks_stay_while_the_middle_goes_and_release_swap_and_fork_skip_dropped_pages():
    m = make()
    sid = running(m, "a", list(range(22)))             # pages 0..5
    step(m, slides=[Slide(sid, 1, 4)])                 # keep page 0 (a sink)
    seq = m.state.seqs[sid]
    assert seq.pages[0] == 0 and seq.pages[1:4] == [DROPPED] * 3
    (child,) = step(m, needs=[Fork(sid, "a/1", 23)]).results
    assert child.granted and child.page_ids[1:4] == [0, 0, 0]   # dropped entries read 0
    # Preempted by swap and back: the dropped pages stay dropped, the rest come back.
    plan = step(m, needs=[Grow(m.state.seqs[child.seq_id].seq_id, 40)], preemption_mode=PreemptionMode.SWAP)
    assert plan.preempted or plan.results[0].granted
    for s in list(m.state.seqs):
        step(m, releases=[s])
    assert m.stats().used_pages == 0 and not any(m.state.tree.live_below)


def test_dropped_pages_stay_blocked_whoever_holds_the_pages_below_them():
    """Liveness is the tree's own: a dropped node is evictable only once no sequence holds a
    node below it, in whatever order the holders let go (and through a swap-out)."""
    m = make()
    a = running(m, "a", list(range(13)))               # pages 0..2 nodes, 3 partial
    (b,) = step(m, needs=[Fork(a, "b", 13)]).results   # b shares 0..2, copies 3 into 4
    step(m, slides=[Slide(a, 0, 2)])                   # a lets go of 0 and 1, keeps node 2
    assert m.state.tree.parked() == []                  # b still holds them
    step(m, slides=[Slide(b.seq_id, 0, 2)])
    assert m.state.tree.evictable() == [] and m.state.tree.num_parked == 2   # blocked by page 2
    m.swap_out(a)                                      # its page 3 leaves; page 2 is b's too
    check_invariants(m.state)
    assert m.state.pool.ref[2] == 2 and m.state.tree.evictable() == []
    step(m, releases=[b.seq_id])
    assert m.state.tree.evictable() == [] and m.state.available() == 16 - 3
    m.release(a)
    check_invariants(m.state)
    assert m.state.tree.evictable() == [2, 1, 0]       # leaves first
    assert not any(m.state.tree.live_below) and m.state.available() == 16


def test_a_blocked_page_a_drop_parks_is_not_room_for_a_truncations_copy():
    """A truncation's copy page: the pages it drops count as room only if they free or park
    evictable; one that parks blocked (a slid sequence holds its child) does not. Refused
    whole, with nothing changed, by the fine-grained call and by a Step (a release in the
    same Step counted alike)."""
    m = make(num_pages=6)
    b = running(m, "b", list(range(12)))            # pages 0, 1, 2: nodes
    step(m, slides=[Slide(b, 0, 2)])                # 0 and 1 blocked: b holds 2, their child
    (a,) = step(m, needs=[Admit("a", list(range(8)) + [99])]).results   # hits 0, 1; page 3 new
    m.truncate(a.seq_id, 1)                         # a is [0, 1]: page 3 freed
    step(m, needs=[Admit("fill", [7] * 12)])        # the pool is full
    assert m.state.available() == 0
    before = snapshot(m.state)
    # down to 3 tokens: the last page (node 0) must be copied, and dropping page 1 parks it blocked
    with pytest.raises(ResourceExhausted, match="needs 1 page for the copy"):
        m.truncate(a.seq_id, 5)
    with pytest.raises(ResourceExhausted, match="needs 1 page for the copy"):
        m.step(StepRequest(truncations=[Truncation(a.seq_id, 5)]))
    assert snapshot(m.state) == before
    check_invariants(m.state)
    # b let go of page 2: page 1 parks evictable now, and with it room for the copy
    step(m, slides=[Slide(b, 2, 3)])
    pages, _, copies = m.truncate(a.seq_id, 5)
    assert len(copies) == 1 and len(pages) == 1
    check_invariants(m.state)


def test_a_release_in_the_same_step_counts_as_room_only_for_pages_that_park_evictable():
    m = make(num_pages=6)
    c = running(m, "c", list(range(12)))            # pages 0, 1, 2
    (a,) = step(m, needs=[Fork(c, "a")]).results    # a shares 0, 1, 2
    step(m, slides=[Slide(c, 0, 2)])                # c keeps 2; 0, 1 are a's alone
    d = running(m, "d", [5] * 8)                    # pages 3, 4: nodes
    step(m, needs=[Admit("f", [9, 9])])             # page 5: the pool is full
    assert m.state.available() == 0
    before = snapshot(m.state)
    # releasing a parks 0 and 1 blocked (c holds 2): no room for d's copy of its node page 4
    with pytest.raises(ResourceExhausted, match="needs 1 page for the copy"):
        m.step(StepRequest(releases=[a.seq_id], truncations=[Truncation(d, 3)]))
    assert snapshot(m.state) == before
    step(m, slides=[Slide(c, 2, 3)])                # c lets go of 2: releasing a now frees room
    plan = step(m, releases=[a.seq_id], truncations=[Truncation(d, 3)])
    assert len(plan.copies) == 1


def test_a_prompt_hitting_blocked_pages_is_charged_only_for_what_it_takes():
    """Blocked pages were never counted as available: a prompt that hits them costs none of
    the available pages (they were counted twice, and what fitted was refused)."""
    m = make(num_pages=6)
    b = running(m, "b", list(range(12)))            # pages 0, 1, 2
    step(m, slides=[Slide(b, 0, 2)])                # 0, 1 blocked
    step(m, needs=[Admit("fill", [7] * 8)])         # pages 3, 4: one page left
    assert m.state.available() == 1 and m.stats().cached_pages == 0
    need = Admit("a", list(range(8)) + [99])        # hits 0 and 1, needs one page
    check = m.can_allocate(need)
    assert check.ok and check.pages_available == 1
    (a,) = step(m, needs=[need]).results
    assert a.granted and a.cached_tokens == 8
    check_invariants(m.state)
    step(m, releases=[a.seq_id])
    step(m, needs=[Grow(b, 13)])                    # a page of its own, to move
    m.swap_out(b)                                   # b keeps its tree page 2 (below)
    (r,) = step(m, needs=[Resume(b)]).results
    assert r.granted
    check_invariants(m.state)


def test_a_slid_sequence_keeps_its_tree_pages_on_the_device_through_a_swap():
    """Taken back, a tree page could only be a private copy between tree pages; so a slid
    sequence swaps out only its private pages that are not in the tree."""
    m = make(num_pages=12)
    a = running(m, "a", list(range(16)))            # pages 0..3: nodes
    (c,) = step(m, needs=[Fork(a, "c")]).results    # c shares them
    step(m, slides=[Slide(a, 1, 2)])                # a lets go of page 1: c alone holds it
    step(m, slides=[Slide(c.seq_id, 0, 1)])
    step(m, needs=[Grow(c.seq_id, 18)])             # a private page past them
    seq = m.state.seqs[c.seq_id]
    assert [device for device, _ in m.swap_out(c.seq_id)] == [4]
    assert seq.pages[:4] == [DROPPED, 1, 2, 3]      # its tree pages stayed
    check_invariants(m.state)
    (r,) = step(m, needs=[Resume(c.seq_id)]).results
    assert r.granted and seq.pages[:4] == [DROPPED, 1, 2, 3]
    check_invariants(m.state)


def test_a_grow_no_preemption_could_serve_preempts_nobody():
    m = make(num_pages=16)
    sids = [running(m, f"r{i}", [i] * 5) for i in range(4)]
    (r,) = step(m, needs=[Grow(sids[0], 2**32 - 1)]).results
    assert not r.granted and "even with every other sequence gone" in r.reason
    assert list(m.state.running) == sids and not m.state.counters.preemptions_recompute
    # pages the grower's own slide left blocked come back from no preemption either
    m = make(num_pages=8)
    a = running(m, "a", list(range(16)))              # pages 0..3
    step(m, slides=[Slide(a, 0, 3)])                  # 0..2 blocked: a holds node 3 below them
    b = running(m, "b", [50 + i for i in range(8)])   # pages 4, 5
    plan = step(m, needs=[Grow(a, 36)])               # 5 more pages: at most 4 could ever be had
    assert not plan.results[0].granted and plan.preempted == [] and list(m.state.running) == [a, b]


def test_a_release_earlier_in_the_step_unshares_a_truncations_last_page():
    """Released first, the sharer leaves the page to the truncated sequence alone: no copy is
    needed, though validation priced one from the refcounts before the Step and refused it."""
    m = make(num_pages=4)
    a = running(m, "a", list(range(5)))          # page 0 (a node), page 1 (partial)
    step(m, slides=[Slide(a, 0, 1)])              # slid: it stores nothing more in the tree
    step(m, needs=[Grow(a, 8)])
    step(m, commits=[Commit(a, 8, [5, 6, 7])])   # page 1 full, private
    (b,) = step(m, needs=[Fork(a, "b")]).results  # b shares page 1
    running(m, "c", [20 + i for i in range(12)])  # the pool is full
    assert m.state.available() == 0
    plan = step(m, releases=[b.seq_id], truncations=[Truncation(a, 2)])
    assert plan.copies == []
