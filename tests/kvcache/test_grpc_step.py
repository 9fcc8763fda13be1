"""Step, the engine's round trip, over gRPC: admission from the cache, grow, commit,
release, truncation, fork, preemption (RECOMPUTE and SWAP, always the tail of the
running order), resume, the stale-epoch refusal, and the ordering rules the
proto states for the copies a response plans.

Server: 16 pages of 4 tokens, 8 seq ids, 8 CPU pages; ids are handed out FIFO.
"""

from __future__ import annotations

import grpc

from kvserve.kvcache_service.core import ManagerConfig
from kvserve.kvcache.v1 import kvcache_pb2 as pb
from tests.kvcache.conftest import (
    KV,
    RECOMPUTE,
    RUNNING,
    SWAP,
    SWAPPED,
    T10,
    T16,
    admit,
    commit,
    copies,
    fill_four,
    fork,
    fresh_stats,
    grow,
    resume,
    rpc_error,
)


# ------------------------------------------------------------------ round trips

def test_step_admission_is_served_from_the_cache_after_commit_and_release(kv: KV) -> None:
    first = kv.step(needs=[admit("a", T10)])
    assert list(first.results) == [pb.NeedResult(granted=True, seq_id=0, page_ids=[0, 1, 2], replaces_table=True,
                                                 cached_tokens=0, num_tokens=10)]
    assert first.available_pages == 13
    kv.step(commits=[commit(0, 10)])  # two full pages enter the tree
    kv.step(releases=[0])              # page 2 is freed, pages 0 and 1 stay cached
    assert kv.stats() == fresh_stats(free_pages=14, cached_pages=2, tree_pages=2, prefix_query_tokens=10,
                                     last_event=1)

    second = kv.step(needs=[admit("b", T10)])
    # seq id 0 went to the back of the queue; page 2 to the back of the free list.
    assert list(second.results) == [pb.NeedResult(granted=True, seq_id=1, page_ids=[0, 1, 3], replaces_table=True,
                                                  cached_tokens=8, num_tokens=2)]
    assert second.available_pages == 13
    s = kv.stats()
    assert (s.prefix_query_tokens, s.prefix_hit_tokens, s.cached_pages, s.used_pages) == (20, 8, 0, 3)

    # The page holding the last prompt token is never a hit: 8 tokens match one page only.
    third = kv.step(needs=[admit("c", T10[:8])])
    assert (third.results[0].cached_tokens, third.results[0].num_tokens) == (4, 4)
    assert list(third.results[0].page_ids) == [0, 4]


def test_step_admission_with_max_tokens_gives_a_prefill_chunk(kv: KV) -> None:
    r = kv.step(needs=[admit("a", T16, max_tokens=5)]).results[0]
    assert (r.granted, list(r.page_ids), r.cached_tokens, r.num_tokens) == (True, [0, 1], 0, 5)
    kv.step(commits=[commit(0, 5)])
    r = kv.step(needs=[grow(0, 16)]).results[0]
    assert (r.granted, r.seq_id, list(r.page_ids), r.replaces_table) == (True, 0, [2, 3], False)


def test_step_commit_then_grow_in_one_step(kv: KV) -> None:
    kv.step(needs=[admit("a", [1, 2, 3, 4])])
    # Commits apply before needs: the sampled token is known when the grow is served.
    step = kv.step(commits=[commit(0, 4, [5])], needs=[grow(0, 5)])
    assert list(step.results) == [pb.NeedResult(granted=True, seq_id=0, page_ids=[1])]
    info = kv.seq(seq_id=0)
    assert (info.num_tokens, info.num_computed, list(info.page_ids)) == (5, 4, [0, 1])
    assert kv.stats().tree_pages == 1
    # A grow within the slots already held takes nothing.
    assert list(kv.step(needs=[grow(0, 8)]).results) == [pb.NeedResult(granted=True, seq_id=0)]


def test_step_releases_truncations_and_fork(kv: KV) -> None:
    kv.step(needs=[admit("a", T10), admit("b", [1, 2, 3])])  # seq 0: pages 0-2; seq 1: page 3
    kv.step(commits=[commit(0, 10)])
    step = kv.step(releases=[1], truncations=[pb.Truncation(seq_id=0, num_tokens=3)],
                   needs=[fork(0, "a-child")])
    # Truncating to 7 tokens drops page 2 and makes page 1 (a cached tree page) the partial
    # last one: it is copied. The free list is then 4.., 3, 2.
    assert copies(step.copies) == [(1, 4), (4, 5)]
    assert list(step.results) == [pb.NeedResult(granted=True, seq_id=2, page_ids=[0, 5], replaces_table=True)]
    assert list(kv.seq(seq_id=0).page_ids) == [0, 4]
    assert kv.seq(request_id="a-child").num_computed == 7


def test_step_grow_preempts_the_tail_with_recompute(kv: KV) -> None:
    fill_four(kv)
    step = kv.step(needs=[grow(0, 17)], mode=RECOMPUTE)
    assert list(step.preempted) == [pb.Preemption(seq_id=3, request_id="r3", mode=RECOMPUTE)]
    # The victim's pages are freed tail first: the free list becomes 15, 14, 13, 12.
    assert list(step.results) == [pb.NeedResult(granted=True, seq_id=0, page_ids=[15])]
    assert (list(step.swap_out), list(step.swap_in), list(step.copies)) == ([], [], [])
    assert step.available_pages == 3
    assert rpc_error(lambda: kv.seq(seq_id=3)).code() == grpc.StatusCode.NOT_FOUND
    s = kv.stats()
    assert (s.preemptions_recompute, s.preemptions_swap, s.num_sequences, s.free_seq_ids) == (1, 0, 3, 5)

    # Next victim is seq 2, the new tail; its four pages make room for four more.
    step = kv.step(needs=[grow(1, 32)], mode=RECOMPUTE)
    assert [p.seq_id for p in step.preempted] == [2]
    assert list(step.results[0].page_ids) == [14, 13, 12, 11]

    # A grow that cannot fit even alone preempts the grower itself, which is then the tail.
    step = kv.step(needs=[grow(1, 64)])
    assert list(step.preempted) == [pb.Preemption(seq_id=1, request_id="r1", mode=RECOMPUTE)]
    assert not step.results[0].granted and "preempted" in step.results[0].reason
    assert kv.stats().num_sequences == 1


def test_step_swap_preemption_then_resume(kv: KV) -> None:
    fill_four(kv)
    step = kv.step(needs=[grow(0, 17)], mode=SWAP)
    assert list(step.preempted) == [pb.Preemption(seq_id=3, request_id="r3", mode=SWAP)]
    # Private pages move tail first to CPU pages 0, 1, 2, 3; device page 15 is then free again.
    assert copies(step.swap_out) == [(15, 0), (14, 1), (13, 2), (12, 3)]
    assert list(step.results) == [pb.NeedResult(granted=True, seq_id=0, page_ids=[15])]
    info = kv.seq(seq_id=3)
    assert (info.state, list(info.page_ids), list(info.cpu_page_ids)) == (SWAPPED, [], [3, 2, 1, 0])
    s = kv.stats()
    assert (s.preemptions_swap, s.num_swapped, s.cpu_free_pages, s.num_sequences) == (1, 1, 4, 4)

    # Nothing fits yet: a resume is refused (an answer, not an error).
    r = kv.step(needs=[resume(3)]).results[0]
    assert not r.granted and "needs 4 pages, 3 available" in r.reason

    step = kv.step(releases=[1], needs=[resume(3)])
    # Free list: 14, 13, 12, then seq 1's pages tail first 7, 6, 5, 4. Copies go head first.
    assert copies(step.swap_in) == [(3, 14), (2, 13), (1, 12), (0, 7)]
    assert list(step.results) == [pb.NeedResult(granted=True, seq_id=3, page_ids=[14, 13, 12, 7],
                                                replaces_table=True)]
    assert step.available_pages == 3
    info = kv.seq(request_id="r3")
    assert (info.state, list(info.page_ids), list(info.cpu_page_ids)) == (RUNNING, [14, 13, 12, 7], [])
    s = kv.stats()
    assert (s.num_swapped, s.cpu_free_pages, s.num_sequences) == (0, 8, 3)


def test_step_with_a_stale_epoch_is_refused_after_register(kv: KV) -> None:
    assert kv.step(needs=[admit("a", T10)]).results[0].granted  # epoch 0 before any Register
    kv.call("Register", pb.RegisterRequest(epoch=5, page_size=4, num_pages=16))
    err = rpc_error(lambda: kv.step(needs=[admit("b", T10)], epoch=4))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "4" in err.details() and "5" in err.details()
    assert kv.step(needs=[admit("b", T10)], epoch=5).results[0].seq_id == 0



def test_step_truncation_copies_into_a_page_it_drops(kv: KV) -> None:
    kv.step(needs=[admit("a", T10)])
    kv.step(commits=[commit(0, 10)])                  # pages 0, 1 in the tree; page 2 private
    kv.step(needs=[admit("fill", list(range(52)))])   # pages 3-15: the pool is full
    step = kv.step(truncations=[pb.Truncation(seq_id=0, num_tokens=3)])
    assert copies(step.copies) == [(1, 2)]
    assert list(kv.seq(seq_id=0).page_ids) == [0, 2]


def test_step_truncation_uses_pages_released_in_the_same_step(kv: KV) -> None:
    kv.step(needs=[admit("a", T10[:8])])
    kv.step(commits=[commit(0, 8)])                   # pages 0, 1 in the tree, both full
    kv.step(needs=[admit("b", list(range(56)))])      # pages 2-15: the pool is full
    # Releases run before truncations: b's fourteen pages are free when the copy is taken.
    step = kv.step(releases=[1], truncations=[pb.Truncation(seq_id=0, num_tokens=1)])
    assert copies(step.copies) == [(1, 15)]
    assert list(kv.seq(seq_id=0).page_ids) == [0, 15]


def test_step_swap_preemption_of_two_victims(kv: KV) -> None:
    fill_four(kv)
    step = kv.step(needs=[grow(0, 36)], mode=SWAP)  # five more pages: seq 3, then seq 2, go
    assert [(p.seq_id, p.request_id, p.mode) for p in step.preempted] == [(3, "r3", SWAP), (2, "r2", SWAP)]
    assert copies(step.swap_out) == [(15, 0), (14, 1), (13, 2), (12, 3), (11, 4), (10, 5), (9, 6), (8, 7)]
    assert list(step.results[0].page_ids) == [15, 14, 13, 12, 11]
    assert [list(kv.seq(seq_id=i).cpu_page_ids) for i in (2, 3)] == [[7, 6, 5, 4], [3, 2, 1, 0]]
    s = kv.stats()
    assert (s.num_swapped, s.cpu_free_pages, s.preemptions_swap, s.free_pages) == (2, 0, 2, 3)
    # Releasing seq 1 frees four pages: seq 3 resumes, seq 2 is refused (three left).
    step = kv.step(releases=[1], needs=[resume(3), resume(2)])
    assert [r.granted for r in step.results] == [True, False]
    assert copies(step.swap_in) == [(3, 10), (2, 9), (1, 8), (0, 7)]
    step = kv.step(releases=[0], needs=[resume(2)])
    assert copies(step.swap_in) == [(7, 6), (6, 5), (5, 4), (4, 11)]
    assert kv.stats().cpu_free_pages == 8


# ------------------------------------------------------------ policy and ordering

def test_a_sequence_preempted_earlier_in_the_step_gets_no_grow(kv: KV) -> None:
    fill_four(kv)
    step = kv.step(needs=[grow(0, 17), grow(3, 17)])
    assert [p.seq_id for p in step.preempted] == [3]
    assert step.results[0].granted
    assert (step.results[1].granted, step.results[1].seq_id) == (False, 3)
    assert "preempted" in step.results[1].reason


def test_a_victim_admitted_in_the_same_step_loses_its_grant_and_is_recomputed(kv: KV) -> None:
    kv.step(needs=[admit("a", T10[:8])])  # seq 0: pages 0, 1
    step = kv.step(needs=[admit("x", list(range(52))), grow(0, 16)], mode=SWAP)  # x: pages 2-14
    # x is the tail: the grow preempts it; it got pages in this step, so RECOMPUTE, not SWAP.
    assert list(step.preempted) == [pb.Preemption(seq_id=1, request_id="x", mode=RECOMPUTE)]
    assert (step.results[0].granted, step.results[0].seq_id) == (False, 1)
    assert list(step.results[1].page_ids) == [15, 14]
    assert list(step.swap_out) == []
    s = kv.stats()
    assert (s.num_sequences, s.free_seq_ids, s.preemptions_recompute, s.preemptions_swap) == (1, 7, 1, 0)


def test_a_fork_child_of_this_step_is_recomputed_never_swapped(kv: KV) -> None:
    kv.step(needs=[admit("p", T10)])  # seq 0: pages 0-2
    kv.step(commits=[commit(0, 10)])
    kv.step(needs=[admit("fill", list(range(48)))])  # seq 1: pages 3-14
    step = kv.step(needs=[fork(0, "child"), grow(1, 52)], mode=SWAP)
    assert list(step.preempted) == [pb.Preemption(seq_id=2, request_id="child", mode=RECOMPUTE)]
    assert not step.results[0].granted and step.results[1].granted
    assert list(step.swap_out) == []
    assert rpc_error(lambda: kv.seq(request_id="child")).code() == grpc.StatusCode.NOT_FOUND
    assert list(kv.seq(seq_id=0).page_ids) == [0, 1, 2]


def test_a_sequence_swapped_when_the_step_starts_is_not_forked_in_it(kv: KV) -> None:
    kv.step(needs=[admit("p", T10)])
    kv.step(commits=[commit(0, 10)])
    kv.call("SwapOut", pb.SwapOutRequest(seq=pb.SequenceRef(seq_id=0)))
    before = kv.stats()
    # The whole request is checked against the state it meets: the parent is swapped.
    err = rpc_error(lambda: kv.step(needs=[resume(0), fork(0, "child")]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "seq id 0" in err.details()
    assert kv.stats() == before  # the resume was not applied either
    assert kv.step(needs=[resume(0)]).results[0].granted
    assert kv.step(needs=[fork(0, "child")]).results[0].granted


def test_admissions_and_resumes_are_first_come_first_served(kv: KV) -> None:
    kv.step(needs=[admit("s", [1, 2])])  # seq 0: page 0
    kv.call("SwapOut", pb.SwapOutRequest(seq=pb.SequenceRef(seq_id=0)))
    kv.step(needs=[admit("big", list(range(60)))])  # 15 pages: one left
    step = kv.step(needs=[admit("x", T10[:8]), resume(0), admit("y", [1])])
    assert [r.granted for r in step.results] == [False, False, False]
    assert step.results[0].reason == "needs 2 pages, 1 available"
    for r in step.results[1:]:  # each would fit alone: nobody overtakes x
        assert "earlier admission or resume was refused" in r.reason
    assert kv.stats().num_sequences == 2
    step = kv.step(needs=[resume(0), admit("y", [1])])
    assert [r.granted for r in step.results] == [True, False]
    assert copies(step.swap_in) == [(0, 0)]


def test_cpu_pages_freed_in_a_step_are_not_reused_in_it(kv_factory) -> None:
    kv = kv_factory(ManagerConfig(num_pages=16, page_size=4, max_seqs=8, cpu_pages=4))
    kv.step(needs=[admit("s", T16), admit("fill", list(range(48)))])  # pages 0-3 and 4-15
    kv.call("SwapOut", pb.SwapOutRequest(seq=pb.SequenceRef(seq_id=0)))  # CPU pages 0-3: all of them
    kv.step(needs=[admit("v", T16)])  # seq 2: pages 3, 2, 1, 0
    # Releasing s frees its CPU pages only at the end of the step: v cannot be swapped
    # into them (the engine may still read them), so it falls back to RECOMPUTE.
    step = kv.step(releases=[0], needs=[grow(1, 49)], mode=SWAP)
    assert list(step.preempted) == [pb.Preemption(seq_id=2, request_id="v", mode=RECOMPUTE)]
    assert list(step.swap_out) == []
    assert list(step.results[0].page_ids) == [0]
    assert kv.stats().cpu_free_pages == 4


def test_a_prompt_larger_than_grpcs_default_message_limit(kv_factory) -> None:
    kv = kv_factory(ManagerConfig(num_pages=2048, page_size=1024, max_seqs=4))
    tokens = list(range(2**22, 2**22 + 1_200_000))  # 4-byte varints: about 5 MB, over the 4 MiB default
    assert pb.StepRequest(needs=[admit("long", tokens)]).ByteSize() > 4 * 1024 * 1024
    r = kv.step(needs=[admit("long", tokens)]).results[0]
    assert (r.granted, r.num_tokens, len(r.page_ids)) == (True, 1_200_000, 1172)
    assert kv.seq(request_id="long").num_tokens == 1_200_000
