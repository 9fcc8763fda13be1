"""StepStream: Step over one long-lived stream, with the same answers as unary Step."""

from __future__ import annotations

import grpc

from kvserve.kvcache.v1 import kvcache_pb2 as pb
from tests.kvcache.conftest import RPC_TIMEOUT_S, admit, commit, grow, prompt


def script() -> list[pb.StepRequest]:
    """Admissions, commits, growth, a preemption and releases: a busy little run."""
    return [
        pb.StepRequest(needs=[admit("a", prompt(0)), admit("b", prompt(1))]),
        pb.StepRequest(commits=[commit(0, len(prompt(0))), commit(1, len(prompt(1)))],
                       needs=[grow(0, 40), grow(1, 40)]),
        pb.StepRequest(needs=[admit("c", prompt(0)), grow(0, 200)]),
        pb.StepRequest(needs=[admit("d", prompt(2))]),
    ]


def test_stream_answers_equal_unary_answers(kv_factory):
    unary, streamed = kv_factory(), kv_factory()
    expected = [unary.call("Step", r) for r in script()]
    responses = streamed.stub.StepStream(iter(script()), timeout=RPC_TIMEOUT_S)
    assert list(responses) == expected
    assert streamed.stats() == unary.stats()


def test_an_error_ends_the_stream_with_its_status_and_changes_nothing(kv):
    requests = [pb.StepRequest(needs=[admit("a", prompt(0))]),
                pb.StepRequest(needs=[grow(7, 4)]),          # unknown seq id
                pb.StepRequest(needs=[admit("b", prompt(1))])]
    responses = kv.stub.StepStream(iter(requests), timeout=RPC_TIMEOUT_S)
    assert next(responses).results[0].granted
    try:
        next(responses)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.NOT_FOUND and "7" in err.details()
    else:
        raise AssertionError("the bad step did not end the stream")
    s = kv.stats()
    assert s.num_sequences == 1  # the first step stands; the bad one and the one after it never ran
    assert kv.step(needs=[admit("b", prompt(1))]).results[0].granted  # and the server serves on
