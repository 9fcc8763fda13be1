"""A client that opens a stream and does not read it: the server keeps at most
--max-unread-tokens of its output (model_service/stream_backlog.py), then cancels the request
(its pages back at once) and ends the stream RESOURCE_EXHAUSTED, marked final for a gateway;
a backlog that is read goes out in messages of bounded size."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.model_service.engine.errors import FINAL_TRAILER, ClientTooSlow
from kvserve.model_service.engine.events import Finished, Tokens
from kvserve.model_service.servicer import MAX_CHUNK_TOKENS, _to_messages
from kvserve.model_service.stream_backlog import StreamBacklog, Unread
from tests.service.conftest import ModelServerThread
from tests.service.util import assert_pages_free, generate, request, wait_until


def test_the_backlog_counts_tokens_and_logprobs_and_overflows_once():
    async def run():
        cancelled = []
        backlog = StreamBacklog(limit=100, entries_per_token=5, on_overflow=lambda: cancelled.append(1))
        for _ in range(10):
            backlog.put_nowait(Tokens([1, 2], "ab"))   # 10 entries each
        assert backlog.waiting == 100 and not cancelled
        assert (await backlog.get()).token_ids == [1, 2] and backlog.waiting == 90
        backlog.put_nowait(Tokens([3], "c"))
        backlog.put_nowait(Tokens([4, 5], "de"))   # 105: over
        assert cancelled == [1] and backlog.waiting == 0
        backlog.put_nowait(Finished("abort", 1, 2, 0, 0.0, 0.0))   # the cancelled request's end: dropped
        unread = await backlog.get()
        assert isinstance(unread, Unread) and isinstance(unread.error, ClientTooSlow) and backlog.empty()
        assert "21 tokens waited unread" in str(unread.error) and "--max-unread-tokens 100" in str(unread.error)
        assert cancelled == [1]
        # one event past the limit alone (a large --stream-interval with logprobs) is no overflow:
        # the client has had no chance to read it
        alone = StreamBacklog(limit=10, entries_per_token=21, on_overflow=lambda: cancelled.append(2))
        alone.put_nowait(Tokens([1], "a"))
        assert (await alone.get()).token_ids == [1] and cancelled == [1]
        alone.put_nowait(Tokens([2], "b"))
        alone.put_nowait(Tokens([3], "c"))   # two waiting, over the limit: the client is behind
        assert cancelled == [1, 2]
    asyncio.run(run())


def test_a_backlog_read_at_last_goes_out_in_chunks_of_bounded_size():
    events = [Tokens([t], "x") for t in range(1000)] + [Finished("length", 3, 1000, 0, 1.0, 2.0)]
    messages = [m for m, _, _ in _to_messages("r", events, lambda t: "x")]
    sizes = [len(m.chunk.token_ids) for m in messages if m.HasField("chunk")]
    assert sum(sizes) == 1000 and max(sizes) == MAX_CHUNK_TOKENS
    assert messages[-1].HasField("finished")


@pytest.fixture(scope="module")
def tight_server(tiny_dirs):
    server = ModelServerThread(tiny_dirs["tiny"], max_unread_tokens=2048)
    try:
        yield server
    finally:
        server.stop()


def test_a_stream_its_client_leaves_unread_is_cancelled_past_the_limit(tight_server):
    engine = tight_server.servicer.engine
    aborted = engine.counters.aborted
    # no BDP probing: the client's window stays at its first 64 KiB, and the server fills it quickly
    with grpc.insecure_channel(tight_server.address, options=[("grpc.http2.bdp_probe", 0)]) as ch:
        stub = pb_grpc.InferenceStub(ch)
        call = stub.Generate(request(prompt="the model", max_tokens=1900, temperature=0, ignore_eos=True,
                                     logprobs=20), timeout=120)
        assert next(call).HasField("prefill_done")
        wait_until(lambda: engine.counters.aborted == aborted + 1, timeout=60, what="the unread request cancelled")
        assert_pages_free(tight_server.servicer)
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the client did not read its stream" in info.value.details(), info.value.details()
        assert dict(info.value.trailing_metadata())[FINAL_TRAILER] == "1"   # no gateway moves it
        # a client that reads gets its whole answer, logprobs and all
        out = generate(stub, request(prompt="the model", max_tokens=300, temperature=0, ignore_eos=True,
                                     logprobs=20))
        assert len(out.tokens) == 300 and out.finished.finish_reason == pb.FINISH_REASON_LENGTH
