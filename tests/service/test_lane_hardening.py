"""The lane against peers that misbehave, without a model: the worker's bound on connections,
deadlines on a frame's bytes and on a TLS handshake, a servicer's own failure told INTERNAL
(only the connection's own failures end a call without a status), and the gateway's words for
a lost lane, which name no exception."""

from __future__ import annotations

import asyncio
import logging
import re
import struct

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import lane_pb2 as lane_pb
from kvserve.model_service import lane_server
from kvserve.model_service.lane_server import LaneServer
from kvserve.services.gateway.lane import LaneChannel
from kvserve.services.plumbing import lane_wire as wire
from kvserve.services.plumbing.tls import ServerTLS
from tests.security.certs import make_certs

GUARD_S = 30   # a test that would hang fails after this long instead


class Answering:
    """Takes every call and answers one message."""

    async def Generate(self, request, context):
        yield pb.GenerateResponse(prefill_done=pb.PrefillDone(prompt_tokens=1))


class Holding:
    """Takes every call in and holds it until it is cancelled."""

    def __init__(self) -> None:
        self.cancelled = False

    async def Generate(self, request, context):
        await context.send_initial_metadata()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        yield pb.GenerateResponse()


class Raising:
    """Fails every call with `exc`, the servicer's own (not the connection's)."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def Generate(self, request, context):
        raise self.exc
        yield pb.GenerateResponse()


async def started(servicer, tls: ServerTLS | None = None, **kwargs) -> LaneServer:
    server = LaneServer(servicer, tls, 1 << 16, **kwargs)
    await server.start("127.0.0.1:0")
    return server


async def connect(server: LaneServer):
    host, port = server.address.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


def call_frame(timeout_ms: int = 0) -> bytes:
    call = lane_pb.LaneCall(request=pb.GenerateRequest(request_id="r"), timeout_ms=timeout_ms)
    return wire.frame(wire.CALL, call.SerializeToString())


async def until(predicate) -> None:
    async with asyncio.timeout(GUARD_S):
        while not predicate():
            await asyncio.sleep(0.01)


async def answered(reader: asyncio.StreamReader) -> bool:
    """Whether a frame comes back, not the connection closed."""
    try:
        async with asyncio.timeout(GUARD_S):
            await wire.read_frame(reader, wire.MAX_REPLY_BYTES)
        return True
    except (asyncio.IncompleteReadError, ConnectionResetError):
        return False


async def closed(reader: asyncio.StreamReader) -> bool:
    try:
        async with asyncio.timeout(GUARD_S):
            return await reader.read() == b""
    except ConnectionResetError:
        return True


async def status_of(reader: asyncio.StreamReader) -> lane_pb.LaneStatus:
    async with asyncio.timeout(GUARD_S):
        while True:
            kind, payload = await wire.read_frame(reader, wire.MAX_REPLY_BYTES)
            if kind == wire.STATUS:
                return lane_pb.LaneStatus.FromString(payload)


async def one_call(servicer, frame: bytes):
    """The status of one call `frame` to a lane server over `servicer`."""
    server = await started(servicer)
    try:
        reader, writer = await connect(server)
        writer.write(wire.MAGIC + frame)
        status = await status_of(reader)
        writer.close()
        return status
    finally:
        await server.close()


def test_connections_past_the_bound_are_closed_unanswered_and_said_once(caplog):
    """Unbounded, each connection held a task, an fd and up to a frame's bytes: the process's fd
    limit, shared with its gRPC port and its manager link, was the only bound."""
    caplog.set_level(logging.WARNING, logger=lane_server.__name__)

    async def main():
        server = await started(Answering(), max_connections=2)
        try:
            held = [await connect(server) for _ in range(2)]
            for _, writer in held:
                writer.write(wire.MAGIC)
            await until(lambda: len(server._connections) == 2)
            for _ in range(2):
                reader, writer = await connect(server)
                writer.write(wire.MAGIC + call_frame())
                assert not await answered(reader)
                writer.close()
            held[0][1].close()   # a place frees: the next connection is served
            await until(lambda: len(server._connections) == 1)
            reader, writer = await connect(server)
            writer.write(wire.MAGIC + call_frame())
            assert await answered(reader)
            writer.close()
            held[1][1].close()
            return server.refused
        finally:
            await server.close()

    assert asyncio.run(main()) == 2
    said = [r for r in caplog.records if "refuses new connections" in r.getMessage()]
    assert len(said) == 1 and "2 are open, as many as it takes" in said[0].getMessage()


@pytest.mark.parametrize("during_a_call", [False, True])
def test_a_frame_that_stops_short_ends_its_connection(monkeypatch, during_a_call):
    """A CALL header claiming --max-request-bytes, then one byte short: its bytes, a task and an
    fd were held for as long as the connection may idle (and, while a call ran, for ever)."""
    monkeypatch.setattr(lane_server, "FRAME_S", 0.2)
    servicer = Holding()

    async def main():
        server = await started(servicer)
        try:
            reader, writer = await connect(server)
            writer.write(wire.MAGIC)
            if during_a_call:
                writer.write(call_frame())
                kind, _ = await wire.read_frame(reader, wire.MAX_REPLY_BYTES)
                assert kind == wire.HEADERS
            writer.write(struct.pack(">IB", 1000, wire.CALL) + b"x" * 999)
            assert await closed(reader)
            writer.close()
            await until(lambda: not server._connections)
        finally:
            await server.close()

    asyncio.run(main())
    assert servicer.cancelled == during_a_call


@pytest.mark.parametrize("exc", [OSError(5, "Input/output error"), TimeoutError(),
                                 ConnectionResetError(104, "Connection reset by peer")], ids=repr)
def test_a_servicers_own_failure_is_internal_not_silence(monkeypatch, caplog, exc):
    """An OSError or TimeoutError of the servicer's own was taken for the connection failing:
    the call ended with no status, and its gateway waited for one."""
    monkeypatch.setattr(lane_server, "IDLE_S", 0.2)   # a call that ended silently: the connection closes
    caplog.set_level(logging.ERROR, logger=lane_server.__name__)

    status = asyncio.run(one_call(Raising(exc), call_frame()))
    assert status.code == grpc.StatusCode.INTERNAL.value[0]
    incident = re.fullmatch(r"internal error in Generate; the server log has the details under incident "
                            r"([0-9a-f]{12})", status.details)
    assert incident, status.details
    (logged,) = [r for r in caplog.records if incident[1] in r.getMessage()]
    assert logged.exc_info[1] is exc


def test_the_deadline_is_still_deadline_exceeded():
    status = asyncio.run(one_call(Holding(), call_frame(timeout_ms=50)))
    assert (status.code, status.details) == (grpc.StatusCode.DEADLINE_EXCEEDED.value[0], "Deadline Exceeded")


class BrokenWriter:
    """A connection whose writes fail: the gateway gone."""

    def __init__(self) -> None:
        self.written = b""

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return False

    async def drain(self) -> None:
        raise ConnectionResetError(104, "Connection reset by peer")


def test_a_gateway_gone_under_a_write_ends_the_call_without_a_status():
    async def main():
        writer = BrokenWriter()
        payload = call_frame()[wire.HEADER.size:]
        await LaneServer(Answering(), None, 1 << 16)._call(lane_pb.LaneCall.FromString(payload), len(payload), writer)
        await asyncio.sleep(0)   # what the call queued is written
        return writer.written

    written = asyncio.run(main())
    kinds = []
    while written:
        length, kind = wire.HEADER.unpack(written[:wire.HEADER.size])
        kinds.append(kind)
        written = written[wire.HEADER.size + length:]
    assert kinds == [wire.HEADERS, wire.MESSAGE]


def test_a_tls_handshake_has_the_openings_deadline(monkeypatch, tmp_path):
    """asyncio's own is 60 s: a connection that never finished its handshake was held that long,
    before the bound on connections (which counts them once it is done) could see it."""
    certs = make_certs(tmp_path / "certs")
    monkeypatch.setattr(lane_server, "OPENING_S", 0.2)

    async def main():
        server = await started(Answering(), ServerTLS(certs.server.cert, certs.server.key))
        try:
            reader, writer = await connect(server)   # and never a ClientHello
            assert await closed(reader)
            writer.close()
        finally:
            await server.close()

    asyncio.run(main())


@pytest.mark.parametrize("failure, words", [
    ("reset", "the worker's lane lost the connection"),
    ("garbage", "the worker's lane sent a frame this gateway cannot read"),
])
def test_a_lost_lane_is_told_in_plain_words(monkeypatch, caplog, failure, words):
    """The exception's class and errno text reached the client ("failed (ConnectionResetError:
    [Errno 104] ..."); they are the log's."""
    caplog.set_level(logging.INFO, logger="kvserve.services.gateway.lane")
    real = wire.read_frame

    async def worker(reader, writer):
        await reader.readexactly(len(wire.MAGIC))
        await real(reader, 1 << 20)
        writer.write(wire.frame(wire.HEADERS) +
                     wire.frame(wire.MESSAGE, b"\xff" * 9 if failure == "garbage" else b""))
        await reader.read()   # until the gateway closes it

    reads = []

    async def resetting(reader, limit, body_s=None):
        reads.append(1)
        if len(reads) > 1:
            raise ConnectionResetError(104, "Connection reset by peer")
        return await real(reader, limit, body_s)
    if failure == "reset":
        monkeypatch.setattr(wire, "read_frame", resetting)

    async def main():
        server = await asyncio.start_server(worker, "127.0.0.1", 0)
        lane = LaneChannel(("127.0.0.1", server.sockets[0].getsockname()[1]), None, None)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async with asyncio.timeout(GUARD_S):
                    async for _ in lane.generate(pb.GenerateRequest(), 10):
                        pass
            return info.value
        finally:
            lane.close()
            server.close()

    err = asyncio.run(main())
    assert (err.code(), err.details()) == (grpc.StatusCode.UNAVAILABLE, words)
    detail = "ConnectionResetError: [Errno 104]" if failure == "reset" else "DecodeError"
    assert any(detail in r.getMessage() for r in caplog.records)
