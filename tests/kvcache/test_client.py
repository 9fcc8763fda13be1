"""The manager's clients: in-process, its answers and its errors reach the caller as the remote
client's do, where the answer is awaited; remote, answers are read off the StepStream as they
arrive, and a wait ends with ManagerUnavailable when the watchdog interrupts it or the manager
stops."""

from __future__ import annotations

import threading
import time

import pytest

from kvserve.kvcache_service.contract.client import InProcessKVClient
from kvserve.kvcache_service.contract.errors import FailedPrecondition, ManagerUnavailable
from kvserve.kvcache_service.contract.types import Admit, StepRequest
from kvserve.kvcache_service.core import KVCacheManager, ManagerConfig


def test_a_step_is_answered_where_it_is_awaited() -> None:
    client = InProcessKVClient(KVCacheManager(ManagerConfig(num_pages=8, page_size=4)))
    client.register(1, 4, 8)
    answer = client.send_step(StepRequest(1, needs=[Admit("a", [1, 2, 3])]))
    assert answer().results[0].page_ids == [0]
    assert client.stats().num_sequences == 1


def test_a_refused_step_raises_its_error_where_it_is_awaited() -> None:
    client = InProcessKVClient(KVCacheManager(ManagerConfig(num_pages=8, page_size=4)))
    client.register(1, 4, 8)
    answer = client.send_step(StepRequest(2))   # an epoch the manager never had
    with pytest.raises(FailedPrecondition, match="epoch 2 was never registered"):
        answer()


# -- the remote client's StepStream ---------------------------------------------------

@pytest.fixture
def remote(tmp_path):
    from kvserve.kvcache_service.contract.client import RemoteKVClient
    from tests.kvcache.conftest import GRPC_CONFIG, ServerThread

    server = ServerThread(f"unix://{tmp_path}/kv.sock", GRPC_CONFIG)
    client = RemoteKVClient(server.address, timeout_s=10)
    client.register(1, GRPC_CONFIG.page_size, GRPC_CONFIG.num_pages)
    yield server, client
    client.close()
    if not getattr(server, "stopped", False):   # a test may have stopped it already
        server.stop()


def test_answers_are_read_as_they_arrive_not_when_awaited(remote) -> None:
    """The engine sends a Step before its forward and awaits the answer after: the answer must be
    off the stream by then, not read only when awaited (docs/architecture.md)."""
    _, client = remote
    answers = [client.send_step(StepRequest(1, needs=[Admit(f"r{i}", [i + 1] * 3)])) for i in range(3)]
    deadline = time.monotonic() + 10
    while client._stream._answers.qsize() < 3:   # read with nobody waiting for them
        assert time.monotonic() < deadline, "answers were not read ahead"
        time.sleep(0.01)
    assert [answer().results[0].page_ids for answer in answers] == [[0], [1], [2]]   # in order


def test_an_interrupted_wait_ends_unavailable_and_the_next_step_opens_a_new_stream(remote) -> None:
    server, client = remote
    assert client.send_step(StepRequest(1, needs=[Admit("a", [1, 2, 3])]))().results[0].page_ids == [0]
    stalled = threading.Event()
    server.loop.call_soon_threadsafe(stalled.wait, 30)   # the manager stalls: the next answer is late
    try:
        answer = client.send_step(StepRequest(1, needs=[Admit("b", [4, 5, 6])]))
        threading.Timer(0.2, client.interrupt).start()   # what the watchdog does to a wait that took too long
        start = time.monotonic()
        with pytest.raises(ManagerUnavailable):
            answer()
        assert time.monotonic() - start < 15, "the wait ran on after the interrupt (to the stall's end)"
    finally:
        stalled.set()
    # b may have reached the manager before its stream closed: c comes after it either way
    assert client.send_step(StepRequest(1, needs=[Admit("c", [7, 8, 9])]))().results[0].page_ids in ([1], [2])


def test_a_stopped_manager_ends_a_waiting_answer_unavailable(remote) -> None:
    server, client = remote
    answer = client.send_step(StepRequest(1, needs=[Admit("a", [1, 2, 3])]))
    assert answer().results[0].page_ids == [0]
    server.stop()
    server.stopped = True
    with pytest.raises(ManagerUnavailable):
        client.send_step(StepRequest(1, needs=[Admit("b", [4, 5, 6])]))()


def test_a_stream_the_manager_ends_cleanly_ends_the_wait_unavailable(remote) -> None:
    """The manager ends the stream with OK once the client's requests end: a wait on it is a
    lost manager to the engine, not a StopIteration it would take for a bug."""
    _, client = remote
    assert client.send_step(StepRequest(1, needs=[Admit("a", [1, 2, 3])]))().results[0].page_ids == [0]
    client._stream._requests.put(None)   # the requests end; the stream is not cancelled
    with pytest.raises(ManagerUnavailable, match="ended the Step stream"):
        client.send_step(StepRequest(1, needs=[Admit("b", [4, 5, 6])]))()


def test_after_a_reset_the_next_answer_is_the_next_steps(remote) -> None:
    _, client = remote
    client.send_step(StepRequest(1, needs=[Admit("a", [1, 2, 3]), Admit("b", [4, 5, 6])]))   # never awaited
    client.reset()   # the engine dropped that Step
    answer = client.send_step(StepRequest(1, needs=[Admit("c", [7, 8, 9])]))()
    assert len(answer.results) == 1   # c's answer, not the two admissions before it
