"""Every KVCacheManager RPC over a real gRPC server, with exact expectations.

The server (conftest.py) has 16 pages of 4 tokens, 8 seq ids and 8 CPU pages; a
fresh manager hands out page ids and seq ids 0, 1, 2, ... FIFO, and a freed id
goes to the back of its queue. Step is in test_grpc_step.py, error codes in
test_grpc_errors.py, events in test_grpc_events.py.
"""

from __future__ import annotations

import grpc

from kvserve.kvcache_service.contract.hashing import page_hashes
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
    pools,
    resume,
    rpc_error,
)


# --------------------------------------------------------------------- Register

def test_register_resets_on_a_new_epoch_only(kv: KV, caplog) -> None:
    caplog.set_level("INFO", logger="kvserve.kvcache_service.servicer")
    kv.admit("before", T10)
    first = kv.call("Register", pb.RegisterRequest(epoch=7, page_size=4, num_pages=16, instance="model-0"))
    assert first == pb.RegisterResponse(reset=True, page_size=4, num_pages=16, cpu_pages=8, max_seqs=8)
    assert pools(kv.stats()) == pools(fresh_stats(epoch=7, last_event=1))  # the reset is an event

    assert kv.admit("after", T10).seq_id == 0  # reset: ids start over
    again = kv.call("Register", pb.RegisterRequest(epoch=7, page_size=4, num_pages=16))
    assert again == pb.RegisterResponse(reset=False, page_size=4, num_pages=16, cpu_pages=8, max_seqs=8)
    assert kv.seq(request_id="after").page_ids == [0, 1, 2]  # same epoch: nothing dropped

    assert kv.call("Register", pb.RegisterRequest(epoch=8, page_size=4, num_pages=16)).reset
    assert kv.stats().num_sequences == 0 and kv.stats().epoch == 8
    # the log says who took the pool, and what the one before lost with it
    assert "model service 'model-0' at " in caplog.text and "registered epoch 7" in caplog.text
    assert "registered epoch 8 in place of epoch 7: 1 sequences dropped" in caplog.text


def test_a_model_service_with_fewer_swap_pages_than_the_manager_is_refused(kv: KV) -> None:
    """Its swaps would be planned into CPU pages it does not have: the first swap failed its engine
    step, and every request in flight with it. Unset (an older client) is not checked."""
    err = rpc_error(lambda: kv.call("Register", pb.RegisterRequest(epoch=7, page_size=4, num_pages=16, cpu_pages=4)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == ("register: the model service holds 4 CPU swap pages, fewer than the manager's 8 "
                             "(--cpu-pages): swaps would be planned into pages it does not have")
    for enough in (8, 64, None):
        assert kv.call("Register", pb.RegisterRequest(epoch=8, page_size=4, num_pages=16, cpu_pages=enough))


def test_a_stale_epochs_register_is_refused_and_the_live_state_is_intact(kv: KV) -> None:
    kv.call("Register", pb.RegisterRequest(epoch=8, page_size=4, num_pages=16))
    kv.step(needs=[admit("live", T10)], epoch=8)
    before = kv.stats()
    err = rpc_error(lambda: kv.call("Register", pb.RegisterRequest(epoch=1, page_size=4, num_pages=16)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "epoch 1 is older than the live epoch 8" in err.details()
    assert kv.stats() == before and kv.seq(request_id="live").page_ids == [0, 1, 2]
    assert kv.step(needs=[grow(0, 13)], epoch=8).results[0].granted   # the live service goes on


# ---------------------------------------------------------- CanAllocate / Allocate

def test_can_allocate_then_allocate_counts_cached_pages(kv: KV) -> None:
    need = admit("a", T16)
    assert kv.can_allocate(need) == pb.CanAllocateResponse(ok=True, pages_needed=4, pages_available=16)
    assert kv.stats() == fresh_stats()  # a pure check
    assert list(kv.allocate(need).result.page_ids) == [0, 1, 2, 3]
    kv.commit(0, 16)
    kv.release(seq_id=0)  # four cached pages
    for i in range(3):
        kv.admit(f"fill{i}", T16, extra_key="other")  # seqs 1-3, pages 4-15
    # Three of the cached pages are hits (the last page never is); they stop being evictable,
    # so one page is available for the rest: the fourth cached page, evicted.
    again = admit("again", T16)
    assert kv.can_allocate(again) == pb.CanAllocateResponse(ok=True, pages_needed=1, pages_available=1)
    r = kv.allocate(again).result
    assert (r.seq_id, list(r.page_ids), r.cached_tokens, r.num_tokens) == (4, [0, 1, 2, 3], 12, 4)
    assert kv.stats().evictions == 1

    check = kv.can_allocate(admit("more", [1]))
    assert (check.ok, check.pages_needed, check.pages_available) == (False, 1, 0)
    assert check.reason == "needs 1 pages, 0 available"
    err = rpc_error(lambda: kv.allocate(admit("more", [1])))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == "needs 1 pages, 0 available"


def test_allocate_without_a_free_seq_id_is_resource_exhausted(kv: KV) -> None:
    for i in range(8):
        assert kv.admit(f"s{i}", [i]).seq_id == i
    check = kv.can_allocate(admit("ninth", [9]))
    assert (check.ok, check.reason) == (False, "no free seq id")
    before = kv.stats()
    err = rpc_error(lambda: kv.allocate(admit("ninth", [9])))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "seq id" in err.details()
    assert kv.stats() == before
    # Step answers instead of failing.
    r = kv.step(needs=[admit("ninth", [9])]).results[0]
    assert (r.granted, r.reason) == (False, "no free seq id")
    kv.release(request_id="s3")
    assert kv.admit("ninth", [9]).seq_id == 3


def test_allocate_grow_resume_and_fork(kv: KV) -> None:
    kv.admit("a", T10)
    kv.commit(0, 10)
    grown = kv.allocate(grow(0, 13))
    assert grown == pb.AllocateResponse(result=pb.NeedResult(granted=True, seq_id=0, page_ids=[3]))
    forked = kv.allocate(fork(0, "child"))
    assert forked == pb.AllocateResponse(
        result=pb.NeedResult(granted=True, seq_id=1, page_ids=[0, 1, 4], replaces_table=True),
        copies=[pb.PageCopy(src=2, dst=4)])
    kv.call("SwapOut", pb.SwapOutRequest(seq=pb.SequenceRef(seq_id=1)))  # only page 4 is private
    resumed = kv.allocate(resume(1, 13))
    assert resumed == pb.AllocateResponse(
        result=pb.NeedResult(granted=True, seq_id=1, page_ids=[0, 1, 5, 6], replaces_table=True),
        swap_in=[pb.PageCopy(src=0, dst=5)])


# ----------------------------------------------------------- Commit / Release

def test_commit_stores_full_computed_pages_once(kv: KV) -> None:
    kv.admit("a", T10)
    assert kv.commit(0, 8) == 2
    assert kv.commit(0, 10) == 0          # page 2 is partial
    assert kv.commit(0, 10, [7, 7]) == 0  # 12 tokens known, 10 computed
    assert kv.commit(0, 12) == 1
    s = kv.stats()
    assert (s.tree_pages, s.used_pages, s.cached_pages, s.last_event) == (3, 3, 0, 2)
    info = kv.seq(seq_id=0)
    assert (info.num_tokens, info.num_computed) == (12, 12)


def test_release_by_id_and_by_request_id(kv: KV) -> None:
    kv.admit("a", T10)
    kv.admit("b", T10, extra_key="k")
    kv.commit(0, 10)
    assert kv.release(request_id="a") == pb.ReleaseResponse(pages_freed=1, pages_cached=2)
    assert kv.release(seq_id=1) == pb.ReleaseResponse(pages_freed=3, pages_cached=0)
    err = rpc_error(lambda: kv.release(seq_id=1))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "1" in err.details()
    err = rpc_error(lambda: kv.release(request_id="a"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "'a'" in err.details()
    assert kv.stats() == fresh_stats(free_pages=14, cached_pages=2, tree_pages=2, prefix_query_tokens=20,
                                     last_event=1)


# ------------------------------------------------------------------ MatchPrefix

def test_match_prefix_is_read_only(kv: KV) -> None:
    kv.admit("a", T10)
    kv.commit(0, 10)
    kv.release(seq_id=0)
    before = kv.stats()
    hashes = page_hashes(T10, 4)
    match = kv.call("MatchPrefix", pb.MatchPrefixRequest(token_ids=T10))
    assert match == pb.MatchPrefixResponse(cached_tokens=8, page_hashes=hashes)
    # Unlike admission, a match may cover the last token.
    assert kv.call("MatchPrefix", pb.MatchPrefixRequest(token_ids=T10[:8])).cached_tokens == 8
    assert kv.call("MatchPrefix", pb.MatchPrefixRequest(token_ids=T10[:7])).page_hashes == hashes[:1]
    assert kv.call("MatchPrefix", pb.MatchPrefixRequest(token_ids=T10, extra_key="x")).cached_tokens == 0
    assert kv.call("MatchPrefix", pb.MatchPrefixRequest(token_ids=[9] + T10[1:])).cached_tokens == 0
    assert kv.stats() == before


# ------------------------------------------------------------- Fork / Truncate

def test_fork_shares_full_pages_and_copies_the_partial_one(kv: KV) -> None:
    kv.admit("parent", T10)
    kv.commit(0, 10)
    by_id = kv.call("Fork", pb.ForkRequest(parent=pb.SequenceRef(seq_id=0), request_id="c1"))
    assert by_id == pb.ForkResponse(seq_id=1, page_ids=[0, 1, 3], copies=[pb.PageCopy(src=2, dst=3)])
    by_request = kv.call("Fork", pb.ForkRequest(parent=pb.SequenceRef(request_id="parent"), request_id="c2"))
    assert by_request == pb.ForkResponse(seq_id=2, page_ids=[0, 1, 4], copies=[pb.PageCopy(src=2, dst=4)])
    child = kv.seq(request_id="c1")
    assert (child.num_tokens, child.num_computed, child.extra_key) == (10, 10, "")
    assert kv.stats().used_pages == 5
    # Released children leave the shared pages to the parent.
    assert kv.release(seq_id=1) == pb.ReleaseResponse(pages_freed=1, pages_cached=0)

    kv.admit("even", T16, extra_key="e")  # pages 5-8
    kv.commit(3, 16)
    aligned = kv.call("Fork", pb.ForkRequest(parent=pb.SequenceRef(seq_id=3), request_id="c3"))
    assert aligned == pb.ForkResponse(seq_id=4, page_ids=[5, 6, 7, 8])  # nothing to copy


def test_truncate_copies_a_shared_page_that_becomes_the_last(kv: KV) -> None:
    kv.admit("a", T10)
    kv.commit(0, 10)
    out = kv.call("Truncate", pb.TruncateRequest(seq=pb.SequenceRef(seq_id=0), num_tokens=3))
    assert out == pb.TruncateResponse(page_ids=[0, 3], pages_freed=1, copies=[pb.PageCopy(src=1, dst=3)])
    info = kv.seq(seq_id=0)
    assert (info.num_tokens, info.num_computed, list(info.page_ids)) == (7, 7, [0, 3])
    s = kv.stats()
    assert (s.tree_pages, s.cached_pages, s.used_pages) == (2, 1, 2)

    kv.admit("b", T10, extra_key="k")  # private pages 4, 5, 6
    out = kv.call("Truncate", pb.TruncateRequest(seq=pb.SequenceRef(request_id="b"), num_tokens=5))
    assert out == pb.TruncateResponse(page_ids=[4, 5], pages_freed=1)



def test_truncate_and_get_sequence_of_a_slid_sequence_show_its_dropped_slots_as_0(kv: KV) -> None:
    """A slide's slots read 0 in every table the manager gives (Truncate's failed encoding its
    internal mark after the truncation had run: UNKNOWN, with the state changed)."""
    kv.admit("a", T16[:14])
    kv.commit(0, 14)
    kv.call("Step", pb.StepRequest(slides=[pb.Slide(seq_id=0, first_page=0, end_page=2)]))
    out = kv.call("Truncate", pb.TruncateRequest(seq=pb.SequenceRef(seq_id=0), num_tokens=1))
    assert list(out.page_ids) == [0, 0, 2, 3]
    info = kv.seq(seq_id=0)
    assert (info.num_tokens, list(info.page_ids)) == (13, [0, 0, 2, 3])


def test_truncate_in_a_full_pool_copies_into_a_page_it_drops(kv: KV) -> None:
    kv.admit("a", T10)
    kv.commit(0, 10)                   # pages 0, 1 in the tree; page 2 partial and private
    kv.admit("fill", list(range(52)))  # pages 3-15: nothing free, nothing cached
    out = kv.call("Truncate", pb.TruncateRequest(seq=pb.SequenceRef(seq_id=0), num_tokens=3))
    # Page 2 is dropped (freed) first, then taken for the copy of page 1.
    assert out == pb.TruncateResponse(page_ids=[0, 2], pages_freed=1, copies=[pb.PageCopy(src=1, dst=2)])


# ------------------------------------------------------------- SwapOut / SwapIn

def test_swap_out_and_in_of_private_pages(kv: KV) -> None:
    kv.admit("a", T10)
    out = kv.call("SwapOut", pb.SwapOutRequest(seq=pb.SequenceRef(seq_id=0)))
    assert copies(out.swap_out) == [(2, 0), (1, 1), (0, 2)]
    info = kv.seq(seq_id=0)
    assert (info.state, list(info.page_ids), list(info.cpu_page_ids)) == (SWAPPED, [], [2, 1, 0])
    s = kv.stats()
    assert (s.free_pages, s.cpu_free_pages, s.num_swapped, s.num_sequences) == (16, 5, 1, 1)

    back = kv.call("SwapIn", pb.SwapInRequest(seq=pb.SequenceRef(request_id="a")))
    # The free list is 3..15, 2, 1, 0: the table is rebuilt from its head.
    assert back == pb.SwapInResponse(page_ids=[3, 4, 5], swap_in=[pb.PageCopy(src=2, dst=3),
                                                                  pb.PageCopy(src=1, dst=4),
                                                                  pb.PageCopy(src=0, dst=5)])
    s = kv.stats()
    assert (s.used_pages, s.cpu_free_pages, s.num_swapped) == (3, 8, 0)


def test_swap_in_shares_tree_pages_still_cached_on_the_device(kv: KV) -> None:
    kv.admit("a", T10)
    kv.commit(0, 10)
    out = kv.call("SwapOut", pb.SwapOutRequest(seq=pb.SequenceRef(seq_id=0)))
    assert copies(out.swap_out) == [(2, 0), (1, 1), (0, 2)]
    assert kv.stats().cached_pages == 2
    back = kv.call("SwapIn", pb.SwapInRequest(seq=pb.SequenceRef(seq_id=0)))
    assert back == pb.SwapInResponse(page_ids=[0, 1, 3], swap_in=[pb.PageCopy(src=0, dst=3)])


# ------------------------------------------------------------- GetSequence / GetStats

def test_get_sequence_by_seq_id_and_request_id(kv: KV) -> None:
    kv.admit("a", T10)
    kv.commit(0, 10)
    kv.release(seq_id=0)
    kv.admit("b", T10, max_tokens=1)
    expected = pb.SequenceInfo(seq_id=1, request_id="b", state=RUNNING, num_tokens=10, num_computed=8,
                               page_ids=[0, 1, 3], cached_tokens=8)
    assert kv.seq(seq_id=1) == expected
    assert kv.seq(request_id="b") == expected
    kv.admit("k", [1, 2], extra_key="tenant")
    assert kv.seq(request_id="k").extra_key == "tenant"
    for ref in ({"seq_id": 0}, {"request_id": "a"}):
        assert rpc_error(lambda: kv.seq(**ref)).code() == grpc.StatusCode.NOT_FOUND


def test_get_stats_fields_follow_the_state(kv: KV) -> None:
    assert kv.stats() == fresh_stats()
    kv.call("Register", pb.RegisterRequest(epoch=3, page_size=4, num_pages=16))  # event 1: reset
    fill_four(kv, epoch=3)
    kv.step(epoch=3, commits=[commit(i, 16) for i in range(4)])  # events 2-5: four chains stored
    assert kv.stats() == fresh_stats(epoch=3, last_event=5, free_pages=0, used_pages=16, num_sequences=4,
                                     free_seq_ids=4, prefix_query_tokens=64, tree_pages=16)
    kv.step(epoch=3, releases=[1])                     # pages 7, 6, 5, 4 parked, in that order
    kv.step(epoch=3, needs=[grow(0, 17)], mode=SWAP)   # evicts page 7 (event 6), no preemption
    kv.step(epoch=3, needs=[grow(2, 17)], mode=SWAP)   # evicts page 6 (event 7)
    # Three pages wanted, two cached: seq 3 (the tail) is swapped out; its tree pages stay
    # cached on the device, so pages 5, 4 and 15 are evicted (event 8).
    step = kv.step(epoch=3, needs=[grow(0, 32)], mode=SWAP)
    assert [(p.seq_id, p.mode) for p in step.preempted] == [(3, SWAP)]
    assert list(step.results[0].page_ids) == [5, 4, 15]
    # Four wanted, three cached: the grower is the tail now and is preempted itself.
    step = kv.step(epoch=3, needs=[grow(2, 36)], mode=RECOMPUTE)
    assert [(p.seq_id, p.mode) for p in step.preempted] == [(2, RECOMPUTE)]
    assert kv.stats() == fresh_stats(
        epoch=3, free_pages=1, cached_pages=7, used_pages=8, num_sequences=2, free_seq_ids=6,
        cpu_free_pages=4, prefix_query_tokens=64, evictions=5, preemptions_recompute=1,
        preemptions_swap=1, num_swapped=1, tree_pages=11, last_event=8)


# ------------------------------------------------------------------------ Reset

def test_reset_drops_everything_and_ids_start_over(kv: KV) -> None:
    fill_four(kv)
    kv.step(commits=[commit(0, 16)])
    kv.call("SwapOut", pb.SwapOutRequest(seq=pb.SequenceRef(seq_id=1)))
    assert kv.call("Reset", pb.ResetRequest()) == pb.ResetResponse()
    s = kv.stats()
    assert (s.free_pages, s.cached_pages, s.used_pages, s.num_sequences, s.free_seq_ids, s.cpu_free_pages,
            s.num_swapped, s.tree_pages, s.last_event) == (16, 0, 0, 0, 8, 8, 0, 0, 2)
    r = kv.step(needs=[admit("r0", T16)]).results[0]  # a request id from before is free again
    assert (r.seq_id, list(r.page_ids), r.cached_tokens) == (0, [0, 1, 2, 3], 0)
