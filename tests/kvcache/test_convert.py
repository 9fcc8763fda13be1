"""The contract's protobuf conversion: every X_to_pb has an X_from_pb that gives back exactly
what it was given, through the wire bytes, for any value the contract allows."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.kvcache.v1 import kvcache_pb2 as pb
from kvserve.kvcache_service.contract import convert
from kvserve.kvcache_service.contract.errors import InvalidArgument
from kvserve.kvcache_service.contract.types import (
    Admit,
    Allocation,
    CacheReset,
    Check,
    Commit,
    Fork,
    Grow,
    NeedResult,
    PagesEvicted,
    PagesStored,
    Preemption,
    PreemptionMode,
    Resume,
    Slide,
    SeqState,
    SequenceInfo,
    Snapshot,
    Stats,
    StepPlan,
    StepRequest,
    Truncation,
)

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
TOKENS = st.lists(st.integers(0, 2**31 - 1), max_size=20)
IDS = st.text(max_size=12)
PAIRS = st.lists(st.tuples(U32, U32), max_size=6)

NEEDS = st.one_of(
    st.builds(Grow, U32, U32),
    st.builds(Admit, IDS, TOKENS, IDS, st.none() | U32, st.booleans()),
    st.builds(Resume, U32, U32),
    st.builds(Fork, U32, IDS, U32),
)
MODES = st.sampled_from(list(PreemptionMode))
STEP_REQUESTS = st.builds(
    StepRequest, U64, st.lists(U32, max_size=5), st.lists(st.builds(Truncation, U32, U32), max_size=3),
    st.lists(st.builds(Commit, U32, U32, TOKENS), max_size=4), st.lists(NEEDS, max_size=6), MODES,
    st.lists(st.builds(Slide, U32, U32, U32), max_size=3))
RESULTS = st.builds(NeedResult, st.booleans(), U32, st.lists(U32, max_size=8), st.booleans(), U32, U32, IDS)


def _as_the_core_answers(r: NeedResult) -> NeedResult:
    """A granted Grow (granted, not replacing the table) carries only its seq id and page ids:
    the plan's encoding sends nothing else for it."""
    if r.granted and not r.replaces_table:
        return NeedResult(True, r.seq_id, r.page_ids)
    return r


STEP_PLANS = st.builds(
    StepPlan, st.lists(RESULTS.map(_as_the_core_answers), max_size=5), st.lists(st.builds(Preemption, U32, IDS, MODES), max_size=3),
    PAIRS, PAIRS, PAIRS, U32)
STATS = st.builds(Stats, **{f.name: U64 if f.type == f.TYPE_UINT64 else U32
                             for f in pb.Stats.DESCRIPTOR.fields})
SEQUENCES = st.builds(SequenceInfo, U32, IDS, st.sampled_from(list(SeqState)), U32, U32,
                      st.lists(U32, max_size=6), st.lists(U32, max_size=6), U32, IDS)
EVENTS = st.one_of(
    st.builds(PagesStored, U64, U64, st.lists(U64, max_size=5).map(tuple)),
    st.builds(PagesEvicted, U64, st.lists(U64, max_size=5).map(tuple)),
    st.builds(CacheReset, U64),
    st.builds(Snapshot, U64, st.lists(st.tuples(U64, U64), max_size=5).map(tuple)),
)


def _through_the_wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def _round_trip(to_pb: Callable, from_pb: Callable, value) -> None:
    assert from_pb(_through_the_wire(to_pb(value))) == value


@given(NEEDS)
def test_needs(need) -> None:
    _round_trip(convert.need_to_pb, convert.need_from_pb, need)


@given(STEP_REQUESTS)
def test_step_requests(request) -> None:
    back = convert.step_request_from_pb(_through_the_wire(convert.step_request_to_pb(request)))
    # Repeated fields come back as lists, whatever sequence went in.
    assert back == StepRequest(request.epoch, list(request.releases), list(request.truncations),
                               list(request.commits), list(request.needs), request.preemption_mode,
                               list(request.slides))


@given(STEP_PLANS)
def test_step_plans(plan) -> None:
    _round_trip(convert.step_plan_to_pb, convert.step_plan_from_pb, plan)


@given(st.builds(Commit, U32, U32, TOKENS))
def test_commits(c) -> None:
    _round_trip(convert.commit_to_pb, convert.commit_from_pb, c)


@given(RESULTS)
def test_need_results(result) -> None:
    _round_trip(convert.result_to_pb, convert.result_from_pb, result)


@given(st.builds(Check, st.booleans(), U32, U32, IDS))
def test_checks(check) -> None:
    _round_trip(convert.check_to_pb, convert.check_from_pb, check)


@given(st.builds(Allocation, RESULTS, PAIRS, PAIRS))
def test_allocations(allocation) -> None:
    _round_trip(convert.allocation_to_pb, convert.allocation_from_pb, allocation)


@given(SEQUENCES)
def test_sequence_infos(info) -> None:
    _round_trip(convert.sequence_to_pb, convert.sequence_from_pb, info)


@given(STATS)
def test_stats(stats) -> None:
    _round_trip(convert.stats_to_pb, convert.stats_from_pb, stats)


@given(EVENTS)
def test_events(event) -> None:
    _round_trip(convert.event_to_pb, convert.event_from_pb, event)


def test_a_need_with_nothing_set_is_refused_with_a_message() -> None:
    with pytest.raises(InvalidArgument, match="set one of grow, admit, resume, fork"):
        convert.need_from_pb(pb.Need())


def test_an_unknown_preemption_mode_is_refused_with_a_message() -> None:
    with pytest.raises(InvalidArgument, match="unknown preemption_mode 9"):
        convert.step_request_from_pb(pb.StepRequest(preemption_mode=9))


def test_a_snapshot_of_a_message_per_page_from_an_older_manager_is_read() -> None:
    older = pb.Event(number=7, epoch=2, snapshot=pb.Snapshot(pages=[pb.StoredPage(hash=5, parent_hash=0),
                                                                    pb.StoredPage(hash=6, parent_hash=5)]))
    assert convert.event_from_pb(older) == Snapshot(7, ((5, 0), (6, 5)), 2)
    now = convert.event_to_pb(Snapshot(7, ((5, 0), (6, 5)), 2))
    assert list(now.snapshot.hashes) == [5, 6] and list(now.snapshot.parent_hashes) == [0, 5]
    assert not now.snapshot.pages   # packed arrays only: a message per page cost seconds at a large cache
    with pytest.raises(ValueError, match="2 hashes and 1 parents"):
        convert.event_from_pb(pb.Event(snapshot=pb.Snapshot(hashes=[5, 6], parent_hashes=[0])))
