"""The gateway's side of the lane (protos/kvserve/inference/v1/lane.proto): a worker's Generate
over length-prefixed frames instead of gRPC, a hop that costs a fraction of a gRPC call's.

LaneChannel.generate returns a call that behaves as the gRPC stub's does for relay.py: iterated
for the responses, initial_metadata() once the worker took it, cancel(), and every failure raised
as grpc.aio.AioRpcError with gRPC's codes (a lost connection UNAVAILABLE, as a lost gRPC
channel), so the relay's failover reads both alike. One call per connection at a time, idle
connections kept for the next call: TCP's flow control on each is the stream's, so a client that
does not read holds its worker's stream and no other. A lane that cannot be connected to sends
the call over gRPC instead (a firewall may pass one port and not the other).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import lane_pb2 as lane_pb
from kvserve.services.plumbing import lane_wire as wire
from kvserve.services.plumbing.tls import ClientTLS

log = logging.getLogger(__name__)

MAX_IDLE = 64          # idle connections kept per worker
CONNECT_TIMEOUT_S = 2.0
RETRY_LANE_S = 10.0    # after a lane could not be connected to, calls go over gRPC this long


def _error(code: grpc.StatusCode, details: str, trailers: tuple = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


class _Connection:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @property
    def usable(self) -> bool:
        """Still open at both ends: a worker that restarted closed its end of every idle one."""
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.transport.abort()   # no FIN handshake to wait for: the worker sees the call cancelled


class LaneChannel:
    """One worker's lane: where it is, and its idle connections."""

    def __init__(self, target: tuple[str, int] | str, tls: ClientTLS | None, grpc_generate: Callable) -> None:
        self.target = target   # (host, port), or a Unix socket's path
        self._ssl = wire.client_ssl(tls) if isinstance(target, tuple) else None
        self._server_name = (tls.server_name or None) if tls is not None else None
        self._grpc_generate = grpc_generate   # the worker's stub's Generate, when the lane cannot be reached
        self._idle: list[_Connection] = []
        self._down_until = 0.0
        self._tasks: set[asyncio.Task] = set()   # held: the loop keeps only weak references to tasks
        self.calls = self.fallbacks = 0

    def spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None, metadata: tuple = ()) -> LaneCall:
        self.calls += 1
        return LaneCall(self, request, timeout, metadata)

    @property
    def idle(self) -> int:
        """Connections kept for the next call."""
        return len(self._idle)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def _take(self) -> tuple[_Connection, bool] | None:
        """An idle connection (and True), or a new one (False); None when the lane cannot be reached."""
        while self._idle:
            conn = self._idle.pop()
            if conn.usable:
                return conn, True
            conn.close()
        if time.monotonic() < self._down_until:
            return None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                if isinstance(self.target, str):
                    reader, writer = await asyncio.open_unix_connection(self.target)
                else:
                    host, port = self.target
                    reader, writer = await asyncio.open_connection(
                        host, port, ssl=self._ssl, server_hostname=(self._server_name or host) if self._ssl else None)
        except (OSError, TimeoutError) as exc:
            self._down_until = time.monotonic() + RETRY_LANE_S
            log.warning("the lane at %s cannot be reached (%s); calls go over gRPC for %g s", self.where,
                        exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__,
                        RETRY_LANE_S)
            return None
        wire.keep_alive(writer)
        writer.write(wire.MAGIC)
        return _Connection(reader, writer), False

    def _give_back(self, conn: _Connection) -> None:
        if len(self._idle) < MAX_IDLE and conn.usable:
            self._idle.append(conn)
        else:
            conn.close()

    @property
    def where(self) -> str:
        return f"unix://{self.target}" if isinstance(self.target, str) else f"{self.target[0]}:{self.target[1]}"

    async def _settle(self, conn: _Connection) -> None:
        """A call left after its last sequence's end: the worker's status follows, and the
        connection is kept; anything else, or nothing within a second, and it is closed."""
        try:
            async with asyncio.timeout(1.0):
                kind, _ = await wire.read_frame(conn.reader, wire.MAX_REPLY_BYTES)
        except (TimeoutError, asyncio.IncompleteReadError, OSError, wire.FramingError):
            kind = None
        if kind == wire.STATUS:
            self._give_back(conn)
        else:
            conn.close()


class LaneCall:
    """One Generate on the lane, used as relay.py uses a gRPC stub's call."""

    def __init__(self, channel: LaneChannel, request: pb.GenerateRequest, timeout: float | None,
                 metadata: tuple) -> None:
        self._channel = channel
        self._request = request
        self._metadata = metadata
        loop = asyncio.get_running_loop()
        self._deadline = None if timeout is None else loop.time() + timeout
        self._headers: asyncio.Future = loop.create_future()
        self._conn: _Connection | None = None
        self._grpc_call = None   # the call went over gRPC instead
        self._cancelled = self._done = False
        self._reading = False          # a response is being awaited
        self._last_finished = False    # the last response ended a sequence: the status may follow at once

    def cancel(self) -> bool:
        """Ends the call: the worker cancels the request as its connection closes, and a response
        being awaited raises CancelledError, as a gRPC call's does. Cancelled right after a
        sequence's end (the relay leaves once its last sequence finished), the status the worker
        sends next is read in the background and the connection kept."""
        if self._grpc_call is not None:
            return self._grpc_call.cancel()
        if self._done or self._cancelled:
            return False
        self._cancelled = True
        if not self._headers.done():
            self._headers.cancel()
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._last_finished and not self._reading:
                self._channel.spawn(self._channel._settle(conn))
            else:
                conn.close()
        return True

    async def initial_metadata(self):
        """Once the worker took the call (its HEADERS frame); CancelledError if it ended without."""
        return await self._headers

    def __aiter__(self):
        return self._responses()

    async def _within(self, awaitable):
        """`awaitable` awaited within the call's deadline (TimeoutError past it)."""
        async with asyncio.timeout_at(self._deadline):
            return await awaitable

    def _send(self, conn: _Connection) -> None:
        self._conn = conn
        left_ms = 0 if self._deadline is None else \
            max(1, int((self._deadline - asyncio.get_running_loop().time()) * 1000))
        call = lane_pb.LaneCall(request=self._request, timeout_ms=left_ms,
                                metadata=[lane_pb.LaneMetadata(key=k, value=v) for k, v in self._metadata])
        conn.writer.write(wire.frame(wire.CALL, call.SerializeToString()))

    async def _responses(self):
        channel = self._channel
        try:
            taken = await self._within(channel._take())
            if self._cancelled:
                if taken is not None:
                    channel._give_back(taken[0])
                raise asyncio.CancelledError
            if taken is None:   # the lane cannot be reached: the call goes over gRPC
                channel.fallbacks += 1
                left = None if self._deadline is None else \
                    max(0.0, self._deadline - asyncio.get_running_loop().time())
                self._grpc_call = channel._grpc_generate(self._request, timeout=left, metadata=self._metadata)
                channel.spawn(self._headers_from_grpc())
                async for response in self._grpc_call:
                    yield response
                return
            conn, reused = taken
            self._send(conn)
            heard = False   # a frame back: past that, a lost connection is the worker's failure
            while True:
                if self._cancelled:
                    raise asyncio.CancelledError
                self._reading = True
                try:
                    kind, payload = await self._within(wire.read_frame(conn.reader, wire.MAX_REPLY_BYTES))
                    response = pb.GenerateResponse.FromString(payload) if kind == wire.MESSAGE else None
                except TimeoutError:   # the deadline (an OSError too, not the connection's fault)
                    raise
                except (asyncio.IncompleteReadError, OSError, wire.FramingError, DecodeError) as exc:
                    conn.close()
                    self._conn = None
                    if self._cancelled:
                        raise asyncio.CancelledError from None
                    if not heard and reused and isinstance(exc, (asyncio.IncompleteReadError, ConnectionError)):
                        # an idle connection the worker had closed (restarted, or its lane server
                        # stopped) before the call reached it: once more on another
                        taken = await self._within(channel._take())
                        if taken is not None:
                            conn, reused = taken
                            self._send(conn)
                            continue
                    why = "closed the connection" if isinstance(exc, asyncio.IncompleteReadError) else str(exc)
                    raise _error(grpc.StatusCode.UNAVAILABLE, f"the worker's lane at {channel.where} {why}") from None
                finally:
                    self._reading = False
                heard = True
                if kind == wire.MESSAGE:
                    if not self._headers.done():
                        self._headers.set_result(())
                    self._last_finished = response.WhichOneof("event") == "finished"
                    yield response
                elif kind == wire.HEADERS:
                    if not self._headers.done():
                        self._headers.set_result(())
                elif kind == wire.STATUS:
                    status = lane_pb.LaneStatus.FromString(payload)
                    self._conn = None
                    channel._give_back(conn)
                    code = wire.CODES.get(status.code, grpc.StatusCode.UNKNOWN)
                    if code != grpc.StatusCode.OK:
                        raise _error(code, status.details, tuple((m.key, m.value) for m in status.trailing_metadata))
                    return
                else:
                    raise _error(grpc.StatusCode.UNAVAILABLE,
                                 f"the worker's lane at {channel.where} sent a frame of kind {kind}")
        except TimeoutError:
            raise _error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            self._done = True
            if not self._headers.done():
                self._headers.cancel()
            if self._conn is not None:   # left early (cancelled, timed out, failed): the worker cancels it
                self._conn.close()
                self._conn = None

    async def _headers_from_grpc(self) -> None:
        try:
            await self._grpc_call.initial_metadata()
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            if not self._headers.done():
                self._headers.cancel()
            return
        if not self._headers.done():
            self._headers.set_result(())
