"""The lane (protos/kvserve/inference/v1/lane.proto): Generate between a gateway and a worker
without gRPC. The gateway's client (services/gateway/lane.py) against a real model service
(model_service/lane_server.py): the same tokens and the same statuses, in the same words, as
the gRPC port gives; cancels and deadlines free the request; connections kept and reused, a
stale one replaced, an unreachable lane left for gRPC; hostile bytes refused with the server
serving on."""

from __future__ import annotations

import asyncio
import random
import socket
import struct

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.model_service.config import ModelServiceConfig
from kvserve.model_service.engine.errors import ENDED_TRAILER, TAKEN_HEADER
from kvserve.model_service.lane_server import LaneServer
from kvserve.services.gateway.lane import LaneChannel
from kvserve.services.plumbing import lane_wire as wire
from kvserve.services.plumbing.address import CannotListen
from kvserve.services.plumbing.api_keys import TENANT_METADATA
from kvserve.services.plumbing.tls import ClientTLS, aio_channel
from tests.server_thread import LoopThread
from tests.service.conftest import ModelServerThread
from tests.service.util import generate, greedy, request, wait_until

PROMPT = [random.Random(11).randrange(3, 1024) for _ in range(24)]


class LaneClient:
    """A gateway's lane to one worker, on a loop of its own."""

    def __init__(self, worker: str, lane_address: str, tls: ClientTLS | None = None, pings: bool = False) -> None:
        self.thread = LoopThread("lane-client")

        async def make():
            grpc_channel = aio_channel(worker, tls)
            return grpc_channel, LaneChannel(wire.dial_target(worker, lane_address), tls,
                                             pb_grpc.InferenceStub(grpc_channel).Generate, pings=pings)
        self.grpc_channel, self.lane = self.thread.call(make())

    def generate(self, msg: pb.GenerateRequest, timeout: float | None = 30, metadata: tuple = ()):
        async def run():
            return [r async for r in self.lane.generate(msg, timeout, metadata)]
        return self.thread.call(run(), 60)

    def error(self, msg: pb.GenerateRequest, **kwargs) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            self.generate(msg, **kwargs)
        return info.value

    def call(self, coro):
        return self.thread.call(coro, 60)

    def close(self) -> None:
        async def close():
            self.lane.close()
            await self.grpc_channel.close()
        self.thread.call(close())
        self.thread.close()


def tokens(responses) -> list[int]:
    return [t for r in responses if r.WhichOneof("event") == "chunk" for t in r.chunk.token_ids]


def by_sequence(responses) -> dict[int, tuple]:
    """Each sequence's tokens, their logprobs and how it finished."""
    out: dict[int, tuple] = {}
    for r in responses:
        ids, lps, end = out.get(r.index, ((), (), None))
        if r.HasField("chunk"):
            ids += tuple(r.chunk.token_ids)
            lps += tuple(round(lp.logprob, 4) for lp in r.chunk.logprobs)
        elif r.HasField("finished"):
            end = (r.finished.finish_reason, r.finished.usage.completion_tokens)
        out[r.index] = (ids, lps, end)
    return out


@pytest.fixture(scope="module")
def served(tiny_dirs):
    server = ModelServerThread(tiny_dirs["tiny"], listen="127.0.0.1:0", kvcache="inprocess", device="cpu", page_size=4,
                               num_pages=512, lane_listen="127.0.0.1:0", max_request_bytes=64 << 10,
                               trust_tenant_metadata=True)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(served):
    c = LaneClient(served.address, served.servicer.lane.address)
    try:
        yield c
    finally:
        c.close()


def over_grpc(address: str, msg: pb.GenerateRequest):
    with grpc.insecure_channel(address) as ch:
        return generate(pb_grpc.InferenceStub(ch), msg, timeout=30)


def test_the_worker_says_where_its_lane_is(served):
    with grpc.insecure_channel(served.address) as ch:
        info = pb_grpc.InferenceStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.lane_address == served.servicer.lane.address
    assert info.lane_address.startswith("127.0.0.1:") and not info.lane_address.endswith(":0")
    assert info.lane_pings   # a gateway pings its calls


def raw_calls(lane_address: str, *frames: bytes) -> tuple[list[int], bool]:
    """Frames over a bare connection, each after the last call's status: the tokens each call
    got, and whether the worker closed the connection without a status (the last call's)."""
    host, port = lane_address.rsplit(":", 1)
    got: list[int] = []
    with socket.create_connection((host, int(port)), timeout=30) as s, s.makefile("rb") as replies:
        s.sendall(wire.MAGIC)
        for data in frames:
            s.sendall(data)
            if data[4] != wire.CALL:
                continue
            got.append(0)
            while True:
                header = replies.read(5)
                if len(header) < 5:
                    return got, True
                length, kind = struct.unpack(">IB", header)
                payload = replies.read(length)
                if kind == wire.STATUS:
                    break
                if kind == wire.MESSAGE:
                    got[-1] += len(pb.GenerateResponse.FromString(payload).chunk.token_ids)
    return got, False


def test_a_call_whose_gateway_stops_pinging_is_cancelled(served, monkeypatch):
    """A gateway host that vanished mid-stream sends no FIN: the worker's kernel would hold the
    connection until it gave up retransmitting, and the request decoded for nobody. A call that
    asked for pings ends once they stop."""
    from kvserve.inference.v1 import lane_pb2
    monkeypatch.setattr(wire, "MIN_PING_INTERVAL_MS", 10)
    silent = lane_pb2.LaneCall(request=request(token_ids=PROMPT, **greedy(1900)), ping_interval_ms=50)
    got, cut = raw_calls(served.servicer.lane.address, wire.frame(wire.CALL, silent.SerializeToString()))
    assert cut and got[-1] < 1900, (cut, got)
    wait_until(lambda: served.servicer.engine.num_live() == 0, 10, "the unpinged call to end")
    # a call that asked for none (an older gateway) is never ended for its silence; a PING between
    # calls (one crossing a status) is nothing: the next call is answered
    quiet = wire.frame(wire.CALL, lane_pb2.LaneCall(request=request(token_ids=PROMPT, **greedy(300))).SerializeToString())
    got, cut = raw_calls(served.servicer.lane.address, quiet, wire.frame(wire.PING), quiet)
    assert got == [300, 300] and not cut


def test_a_gateway_pings_its_calls_and_they_run_on(served, monkeypatch):
    monkeypatch.setattr(wire, "MIN_PING_INTERVAL_MS", 10)
    monkeypatch.setattr(wire, "PING_INTERVAL_S", 0.05)   # the worker gives up after 0.2 s without one
    c = LaneClient(served.address, served.servicer.lane.address, pings=True)
    try:
        assert len(tokens(c.generate(request(token_ids=PROMPT, **greedy(1900))))) == 1900
    finally:
        c.close()


def test_a_lane_call_streams_what_the_grpc_port_streams(served, client):
    for params in (greedy(12), dict(greedy(6), n=2, logprobs=2), dict(temperature=0.8, seed=7, max_tokens=9)):
        msg = request(token_ids=PROMPT, **params)
        lane = client.generate(msg)
        grpc_stream = over_grpc(served.address, msg).events
        # (how tokens group into chunks depends on timing: each sequence's tokens and end compared)
        assert lane[0].WhichOneof("event") == grpc_stream[0].WhichOneof("event") == "prefill_done"
        assert by_sequence(lane) == by_sequence(grpc_stream)
    assert client.lane.fallbacks == 0 and client.lane.idle == 1   # one connection, kept for each next call


def test_the_workers_headers_say_it_took_the_request_and_a_refusals_do_not(served, client):
    """What a gateway tells a worker that failed with a request taken (it may have been computing
    it) from one that refused it before, over each hop: the lane, gRPC, and gRPC where the lane
    cannot be reached (services/gateway/relay.py)."""
    async def headers(hop, msg) -> tuple:
        call = hop(msg, timeout=30)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError:
            pass
        try:
            return tuple(await call.initial_metadata())
        except asyncio.CancelledError:   # the lane's answer to headers that never came
            return ()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"   # nothing listens there once closed
    unreachable = LaneClient(served.address, closed)
    try:
        taken, refused = request(token_ids=PROMPT, **greedy(2)), request(token_ids=PROMPT, **greedy(5000))
        for c, hop in ((client, client.lane.generate), (client, pb_grpc.InferenceStub(client.grpc_channel).Generate),
                       (unreachable, unreachable.lane.generate)):
            assert (TAKEN_HEADER, "1") in c.call(headers(hop, taken))
            assert (TAKEN_HEADER, "1") not in c.call(headers(hop, refused))
        assert unreachable.lane.fallbacks == 2
    finally:
        unreachable.close()


class TakenAndLostAtOnce(pb_grpc.InferenceServicer):
    """A worker's gRPC port that takes every call in and fails it at once."""

    async def Generate(self, request, context):
        await context.send_initial_metadata(((TAKEN_HEADER, "1"),))
        await context.abort(grpc.StatusCode.UNAVAILABLE, "died")
        yield pb.GenerateResponse()


def test_headers_that_come_in_the_same_read_as_the_failure_count(tmp_path):
    """A worker that takes a call in and fails it at once sends its headers and its status
    together: the call raises before the relay's task waiting for the headers has run, and the
    relay asks the call itself (relay._admitted), so the worker counts as having taken it. Over
    the lane (HEADERS and STATUS in one write) and over its gRPC fallback."""
    from kvserve.services.gateway.relay import _admitted, _note_taken
    from kvserve.services.gateway.worker import Routing

    async def lane_worker(reader, writer):
        while await reader.read(1 << 16):   # a call (after the magic, on a new connection); the
            writer.write(wire.frame(wire.HEADERS) + wire.status_frame(grpc.StatusCode.UNAVAILABLE, "died"))
            await writer.drain()            # connection is kept for the next one

    async def main() -> list[bool]:
        path = str(tmp_path / "lane.sock")
        lane_server = await asyncio.start_unix_server(lane_worker, path)
        grpc_server = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(TakenAndLostAtOnce(), grpc_server)
        port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        lane = LaneChannel(path, None, None)
        gone = LaneChannel(str(tmp_path / "nothing-listens-here.sock"), None, pb_grpc.InferenceStub(channel).Generate)
        out = []
        try:
            for channel_ in (lane, gone):
                for _ in range(3):   # as Relay.run does it
                    call, mark = channel_.generate(pb.GenerateRequest(), 10), Routing()
                    taken = asyncio.ensure_future(_note_taken(call, mark))
                    with pytest.raises(grpc.aio.AioRpcError):
                        async for _ in call:
                            pass
                    taken.cancel()
                    out.append(await _admitted(call))
        finally:
            lane.close()
            gone.close()
            lane_server.close()
            await channel.close()
            await grpc_server.stop(None)
        assert gone.fallbacks == 3
        return out

    assert asyncio.run(main()) == [True] * 6


def test_a_refusal_has_the_grpc_port_s_code_words_and_trailers(served, client):
    for msg in (request(token_ids=PROMPT, **greedy(5000)), request(token_ids=[10**7], **greedy(2)), pb.GenerateRequest()):
        lane = client.error(msg)
        with grpc.insecure_channel(served.address) as ch, pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.InferenceStub(ch).Generate(msg, timeout=30))
        assert (lane.code(), lane.details()) == (info.value.code(), info.value.details())
        assert lane.code() == grpc.StatusCode.INVALID_ARGUMENT
    # a continuation whose tokens already ended the sequence: the trailer a gateway reads
    ended = request(token_ids=PROMPT, **greedy(3))
    ended.continuation.ids.extend([5, 6, 7])
    err = client.error(ended)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (ENDED_TRAILER, "FINISH_REASON_LENGTH") in tuple(err.trailing_metadata())
    assert client.lane.fallbacks == 0


def test_a_request_past_max_request_bytes_is_refused_as_grpc_refuses_it(served, client):
    msg = request(token_ids=PROMPT, **greedy(2))
    msg.sampling.stop.extend(["s" * 1000] * 60)   # 60 KB of stop strings: under 64 KiB
    assert tokens(client.generate(msg))
    del msg.sampling.stop[:]
    msg.sampling.stop.extend(["s" * 1100] * 60)   # 66 KB: past it, the call's frame within what is read
    err = client.error(msg)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details().startswith("Received message larger than max ("), err.details()   # what a gateway reads
    big = request(prompt="x" * (4 << 20), **greedy(2))   # 4 MB: the frame refused unread, its bytes drained
    for _ in range(3):
        err = client.error(big)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert err.details().startswith("Received message larger than max ("), err.details()


def test_cancelling_a_call_frees_its_request_at_once(served, client):
    engine = served.servicer.engine

    async def cancel_after_first_chunk():
        call = client.lane.generate(request(token_ids=PROMPT, **greedy(1500)), 60)
        responses = call.__aiter__()
        while (await responses.__anext__()).WhichOneof("event") != "chunk":
            pass
        await call.initial_metadata()
        assert call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await responses.__anext__()

    client.call(cancel_after_first_chunk())
    wait_until(lambda: engine.num_live() == 0, 10, "the cancelled request to end")
    assert client.lane.idle == 0   # the connection that carried it was closed, not kept
    assert tokens(client.generate(request(token_ids=PROMPT, **greedy(4))))


def test_a_call_left_right_after_its_finished_keeps_its_connection(served, client):
    """The gateway's relay leaves as soon as its last sequence finished, cancelling the call: the
    worker's status follows at once, and the connection goes back for the next call."""
    async def leave_at_finished():
        call = client.lane.generate(request(token_ids=PROMPT, **greedy(3)), 30)
        async for response in call:
            if response.WhichOneof("event") == "finished":
                break
        call.cancel()
        for _ in range(200):
            if client.lane.idle:
                return
            await asyncio.sleep(0.01)

    client.call(leave_at_finished())
    assert client.lane.idle == 1


def test_the_deadline_ends_the_call_and_frees_its_request(served, client):
    err = client.error(request(token_ids=PROMPT, **greedy(1900)), timeout=0.3)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: served.servicer.engine.num_live() == 0, 10, "the request past its deadline to end")


def test_tenants_keep_their_own_caches_over_the_lane(served, client):
    prompt = [random.Random(12).randrange(3, 1024) for _ in range(40)]

    def cached(tenant: str) -> int:
        responses = client.generate(request(token_ids=prompt, **greedy(2)), metadata=((TENANT_METADATA, tenant),))
        return next(r.prefill_done.cached_tokens for r in responses if r.HasField("prefill_done"))

    assert cached("alpha") == 0
    assert cached("alpha") > 0
    assert cached("beta") == 0


def test_an_idle_connection_whose_worker_restarted_is_replaced(served, client):
    assert tokens(client.generate(request(token_ids=PROMPT, **greedy(2))))
    assert client.lane.idle == 1
    old = served.servicer.lane
    served.call(old.close())   # every connection closed, as a restarted worker's were
    lane = LaneServer(served.servicer, None, served.config.max_request_bytes)
    served.call(lane.start(old.address))
    served.servicer.lane = lane
    assert tokens(client.generate(request(token_ids=PROMPT, **greedy(2))))
    assert client.lane.fallbacks == 0


def test_a_lane_closed_for_good_leaves_the_calls_to_grpc(tiny_dirs):
    server = ModelServerThread(tiny_dirs["tiny"], listen="127.0.0.1:0", kvcache="inprocess", device="cpu",
                               page_size=4, num_pages=256, lane_listen="127.0.0.1:0")
    c = LaneClient(server.address, server.servicer.lane.address)
    try:
        msg = request(token_ids=PROMPT, **greedy(4))
        expected = tokens(c.generate(msg))
        assert c.lane.idle == 1 and c.lane.fallbacks == 0
        server.call(server.servicer.lane.close())   # its kept connection closed with it
        server.servicer.lane = None
        assert tokens(c.generate(msg)) == expected
        assert c.lane.fallbacks == 1 and c.lane.failing
    finally:
        c.close()
        server.stop()


def test_a_lane_that_cannot_be_reached_leaves_the_call_to_grpc(served):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"   # nothing listens there once closed
    c = LaneClient(served.address, closed)
    try:
        msg = request(token_ids=PROMPT, **greedy(5))
        assert tokens(c.generate(msg)) == over_grpc(served.address, msg).tokens
        assert c.lane.fallbacks == 1
        c.generate(msg)   # not tried again at once: a call does not wait on a lane known down
        assert c.lane.fallbacks == 2
    finally:
        c.close()


def test_hostile_bytes_on_the_lane_are_refused_and_the_worker_serves_on(served, client):
    host, port = served.servicer.lane.address.rsplit(":", 1)

    def exchange(data: bytes) -> bytes:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out

    assert exchange(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == b""           # not the lane's opening
    assert exchange(wire.MAGIC + struct.pack(">IB", 5, 9) + b"12345") == b""   # a kind it never takes
    huge = exchange(wire.MAGIC + struct.pack(">IB", 1 << 30, wire.CALL))     # a frame of 1 GiB: not read
    kind, payload = huge[4], huge[5:]
    assert kind == wire.STATUS
    from kvserve.inference.v1 import lane_pb2
    status = lane_pb2.LaneStatus.FromString(payload)
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    garbage = exchange(wire.MAGIC + wire.frame(wire.CALL, b"\xff" * 40))
    status = lane_pb2.LaneStatus.FromString(garbage[5:])
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "LaneCall" in status.details
    assert tokens(client.generate(request(token_ids=PROMPT, **greedy(3))))
    wait_until(lambda: served.servicer.engine.num_live() == 0, 10, "nothing left running")


def test_a_draining_worker_refuses_lane_calls_unavailable(tiny_dirs):
    server = ModelServerThread(tiny_dirs["tiny"], listen="127.0.0.1:0", kvcache="inprocess", device="cpu",
                               page_size=4, num_pages=256, lane_listen="127.0.0.1:0")
    c = LaneClient(server.address, server.servicer.lane.address)
    try:
        server.servicer.drain()
        err = c.error(request(token_ids=PROMPT, **greedy(2)))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.details()
    finally:
        c.close()
        server.stop()


def test_a_unix_socket_lane(tiny_dirs, tmp_path):
    server = ModelServerThread(tiny_dirs["tiny"], listen=f"unix://{tmp_path}/w.sock", kvcache="inprocess",
                               device="cpu", page_size=4, num_pages=256, lane_listen=f"unix://{tmp_path}/w.lane")
    try:
        assert server.servicer.lane.address == f"unix://{tmp_path}/w.lane"
        c = LaneClient(server.address, server.servicer.lane.address)
        try:
            msg = request(token_ids=PROMPT, **greedy(6))
            assert tokens(c.generate(msg)) == over_grpc(server.address, msg).tokens
            assert c.lane.fallbacks == 0
        finally:
            c.close()
    finally:
        server.stop()
    assert not (tmp_path / "w.lane").exists()   # its socket file goes with it


def test_where_a_gateway_dials_a_lane():
    assert wire.dial_target("10.0.0.7:50051", "0.0.0.0:50061") == ("10.0.0.7", 50061)
    assert wire.dial_target("worker-0.workers:50051", "[::]:50061") == ("worker-0.workers", 50061)
    assert wire.dial_target("unix:///run/w.sock", "0.0.0.0:50061") == ("127.0.0.1", 50061)
    assert wire.dial_target("unix:///run/w.sock", "unix:///run/w.lane") == "/run/w.lane"
    assert wire.dial_target("10.0.0.7:50051", "unix:///run/w.lane") is None   # a path on the worker's host
    assert wire.dial_target("10.0.0.7:50051", "nonsense") is None
    assert wire.dial_target("10.0.0.7:50051", "127.0.0.1:0") is None


@pytest.mark.parametrize("flags, message", [
    (dict(lane_listen="nonsense"), "--lane-listen"),
    (dict(lane_listen="127.0.0.1:0", api_keys="keys.txt"), "--lane-listen with --api-keys"),
    (dict(lane_listen="0.0.0.0:50061", trust_tenant_metadata=True, listen="unix:///tmp/w.sock"),
     "--trust-tenant-metadata with --lane-listen 0.0.0.0:50061"),
])
def test_lane_flags_that_cannot_work_are_refused_at_start(flags, message):
    with pytest.raises(ValueError, match=message):
        ModelServiceConfig(**{"model": "tiny", **flags})


def test_a_lane_port_in_use_is_said_naming_the_flag(served):
    async def start():
        await LaneServer(served.servicer, None, 1024).start(served.servicer.lane.address)
    with pytest.raises(CannotListen, match="--lane-listen: cannot listen on 127.0.0.1:"):
        served.call(start())


class ScriptedLane:
    """A lane server that answers each call with the frames a test gives (a misbehaving worker)."""

    def __init__(self, thread: LoopThread, answer) -> None:
        self.answer = answer   # async (reader, writer) -> None, after the call's frame is read
        self.writers: list[asyncio.StreamWriter] = []
        read_frame = wire.read_frame   # the real one: a test may patch the gateway's reads

        async def serve(reader, writer):
            self.writers.append(writer)
            try:
                await reader.readexactly(len(wire.MAGIC))
                await read_frame(reader, 1 << 20)
                await self.answer(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        async def start():
            return await asyncio.start_server(serve, "127.0.0.1", 0)
        self.server = thread.call(start())
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


@pytest.fixture
def scripted(served):
    clients: list[LaneClient] = []

    def make(answer) -> LaneClient:
        c = LaneClient(served.address, "127.0.0.1:1")
        c.lane_server = ScriptedLane(c.thread, answer)
        c.lane.target = ("127.0.0.1", int(c.lane_server.address.rsplit(":", 1)[1]))
        clients.append(c)
        return c
    yield make
    for c in clients:
        async def stop(server=c.lane_server.server, writers=c.lane_server.writers):
            for writer in writers:
                writer.transport.abort()
            server.close()
            await server.wait_closed()
        c.call(stop())
        c.close()


def test_a_reply_past_the_size_taken_is_refused_as_grpc_refuses_it_not_moved(scripted):
    async def huge(reader, writer):
        writer.write(wire.frame(wire.HEADERS) + struct.pack(">IB", wire.MAX_REPLY_BYTES + 1, wire.MESSAGE))
        await writer.drain()
        await reader.read()   # until the gateway closes it
    err = scripted(huge).error(request(token_ids=PROMPT, **greedy(2)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED   # relay._too_large: no move
    assert err.details().startswith("Received message larger than max ("), err.details()


def test_a_connection_the_kernel_gave_up_on_is_the_worker_failing_not_the_deadline(scripted, monkeypatch):
    """ETIMEDOUT (the peer's host gone: TCP_USER_TIMEOUT, keepalive) is a TimeoutError, and
    must read as UNAVAILABLE, which moves the request, not DEADLINE_EXCEEDED, which ends it."""
    async def headers_then_nothing(reader, writer):
        writer.write(wire.frame(wire.HEADERS))
        await writer.drain()
        await reader.read()   # until the gateway closes it
    c = scripted(headers_then_nothing)
    real = wire.read_frame
    reads = []

    async def timing_out(reader, limit):
        reads.append(1)
        if len(reads) > 1:
            raise TimeoutError(110, "Connection timed out")
        return await real(reader, limit)
    monkeypatch.setattr(wire, "read_frame", timing_out)
    err = c.error(request(token_ids=PROMPT, **greedy(2)), timeout=30)
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err


def test_a_bad_status_frame_is_the_worker_failing(scripted):
    async def garbage_status(reader, writer):
        writer.write(wire.frame(wire.HEADERS) + wire.frame(wire.STATUS, b"\xff" * 9))
        await writer.drain()
    err = scripted(garbage_status).error(request(token_ids=PROMPT, **greedy(2)))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_a_closed_channel_keeps_no_connection(served, client):
    assert tokens(client.generate(request(token_ids=PROMPT, **greedy(2))))
    assert client.lane.idle == 1

    async def close_then_call():
        client.lane.close()
        return [r async for r in client.lane.generate(request(token_ids=PROMPT, **greedy(2)), 30)]
    assert tokens(client.call(close_then_call()))
    assert client.lane.idle == 0


def test_the_lane_context_has_every_context_method_generate_uses():
    """The servicer's Generate (and status.abort) ask their context for these alone: a lane call
    would end INTERNAL on any other."""
    import inspect
    import re

    from kvserve.model_service import status
    from kvserve.model_service.lane_server import LaneContext
    from kvserve.model_service.servicer import InferenceServicer
    used = set(re.findall(r"context\.(\w+)", inspect.getsource(InferenceServicer.Generate)))
    used |= set(re.findall(r"context\.(\w+)", inspect.getsource(InferenceServicer._tenant)))
    used |= set(re.findall(r"context\.(\w+)", inspect.getsource(status.abort)))
    assert used and all(hasattr(LaneContext, name) for name in used), used


def test_idle_connections_are_closed_after_a_while_oldest_first(served, client, monkeypatch):
    from kvserve.services.gateway import lane as lane_mod
    monkeypatch.setattr(lane_mod, "IDLE_S", 0.4)

    client.call(burst(client.lane, 3))
    assert client.lane.idle == 3
    wait_until(lambda: client.lane.idle == 0, 5, "the idle connections closed")


def test_a_lane_on_every_address_takes_ipv4_too(served):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    lane = LaneServer(served.servicer, None, served.config.max_request_bytes)
    try:
        served.call(lane.start("[::]:0"))
    except CannotListen:
        pytest.skip("cannot listen on [::] here")
    try:
        c = LaneClient(served.address, lane.address)   # dialled at 127.0.0.1, the worker's host
        try:
            assert tokens(c.generate(request(token_ids=PROMPT, **greedy(3))))
            assert c.lane.fallbacks == 0
        finally:
            c.close()
    finally:
        served.call(lane.close())


def test_closing_a_lane_with_kept_connections_logs_nothing(tiny_dirs, caplog):
    server = ModelServerThread(tiny_dirs["tiny"], listen="127.0.0.1:0", kvcache="inprocess", device="cpu",
                               page_size=4, num_pages=256, lane_listen="127.0.0.1:0")
    c = LaneClient(server.address, server.servicer.lane.address)
    try:
        c.call(burst(c.lane, 4))
        assert c.lane.idle == 4
        server.call(server.servicer.lane.close())
        server.servicer.lane = None
    finally:
        c.close()
        server.stop()
    assert "Exception in callback" not in caplog.text and "Traceback" not in caplog.text


async def burst(lane: LaneChannel, n: int) -> None:
    """n calls at once: n connections, kept once they end."""
    async def one():
        return [r async for r in lane.generate(request(token_ids=PROMPT, **greedy(3)), 30)]
    await asyncio.gather(*(one() for _ in range(n)))


def test_the_workers_side_of_a_lane_has_no_user_timeout():
    """Linux applies TCP_USER_TIMEOUT to a peer's zero window: a worker whose gateway stopped
    reading (its client paused) reset the live stream after 40 s. The gateway's side keeps it."""
    import socket

    from kvserve.services.plumbing import lane_wire as wire

    if not hasattr(socket, "TCP_USER_TIMEOUT"):
        pytest.skip("no TCP_USER_TIMEOUT here")

    async def main():
        accepted = asyncio.get_running_loop().create_future()
        server = await asyncio.start_server(lambda r, w: accepted.set_result(w), "127.0.0.1", 0)
        _, gateway_side = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        worker_side = await accepted
        wire.keep_alive(gateway_side)
        wire.keep_alive(worker_side, user_timeout=False)
        got = [w.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
               for w in (gateway_side, worker_side)]
        keepalive = worker_side.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        for w in (gateway_side, worker_side):
            w.close()
        server.close()
        return got, keepalive

    (gateway_timeout, worker_timeout), keepalive = asyncio.run(main())
    assert gateway_timeout == wire.USER_TIMEOUT_MS and worker_timeout == 0 and keepalive


def test_while_a_lane_is_down_one_call_at_a_time_waits_on_its_connect(monkeypatch):
    """Against a port that drops packets every call waited the whole connect timeout, each
    time the lane was tried again: about 1 request in 6 paid 2 s more to its first token. One
    call tries; the others go over gRPC meanwhile."""
    from kvserve.services.gateway import lane as lane_module

    connects = []

    async def dropped(*args, **kwargs):   # a SYN nobody answers
        connects.append(args)
        await asyncio.sleep(60)

    monkeypatch.setattr(lane_module, "CONNECT_TIMEOUT_S", 0.3)
    monkeypatch.setattr(lane_module, "RETRY_LANE_S", 0.0)   # tried again at once
    monkeypatch.setattr(lane_module.asyncio, "open_connection", dropped)

    async def main():
        channel = lane_module.LaneChannel(("10.255.255.1", 9), None, grpc_generate=None)
        assert await channel.take() is None and channel.failing   # found down
        connects.clear()
        answers = await asyncio.gather(*(channel.take() for _ in range(5)))
        return answers, channel.failing

    answers, failing = asyncio.run(main())
    assert answers == [None] * 5 and failing
    assert len(connects) == 1   # the others did not wait on a connect of their own


def test_a_lane_port_that_closes_new_connections_unanswered_leaves_the_call_to_grpc(served):
    """A proxy in front of the lane that finds no worker behind it accepts and closes: the call
    ended UNAVAILABLE and moved from worker to worker, where gRPC would have served it."""
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def accept_and_close():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            conn.recv(1 << 16)   # the opening and the call: read, never answered
            conn.close()
    thread = threading.Thread(target=accept_and_close, daemon=True)
    thread.start()
    c = LaneClient(served.address, f"127.0.0.1:{listener.getsockname()[1]}")
    try:
        msg = request(token_ids=PROMPT, **greedy(5))
        assert tokens(c.generate(msg)) == over_grpc(served.address, msg).tokens
        assert c.lane.failing   # and the next calls go over gRPC without trying it
        c.generate(msg)
        assert c.lane.fallbacks == 2
    finally:
        c.close()
        stop.set()
        thread.join()
        listener.close()
