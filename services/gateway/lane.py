"""The gateway's side of the lane (protos/kvserve/inference/v1/lane.proto): a worker's Generate
over length-prefixed frames instead of gRPC, a hop that costs a fraction of a gRPC call's.

LaneChannel.generate returns a call that behaves as the gRPC stub's does for relay.py: iterated
for the responses, initial_metadata() once the worker took it, cancel() (a response being
awaited raises CancelledError), and every failure raised as grpc.aio.AioRpcError with gRPC's
code and words (a lost connection UNAVAILABLE, the deadline DEADLINE_EXCEEDED, a message past
the size taken RESOURCE_EXHAUSTED "Received message larger than max"), so the relay's failover
reads both alike. One call per connection at a time, idle connections kept for the next call:
TCP's flow control on each is the stream's, so a client that does not read holds its worker's
stream and no other. A lane that cannot be connected to sends the call over gRPC instead (a
firewall may pass one port and not the other). Each connection whose call runs is pinged every
PING_INTERVAL_S where the worker reads pings: were this host to vanish, the worker would end
the call rather than decode for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import lane_pb2 as lane_pb
from kvserve.model_service.engine.errors import TAKEN_HEADER
from kvserve.services.plumbing import lane_wire as wire
from kvserve.services.plumbing.tls import ClientTLS

log = logging.getLogger(__name__)

MAX_IDLE = 256         # idle connections kept per worker: a stream each, up to a large batch's
IDLE_S = 30.0          # an idle connection older than this is closed, not reused (a middlebox may have dropped it)
CONNECT_TIMEOUT_S = 2.0
RETRY_LANE_S = 10.0    # after a lane could not be connected to, calls go over gRPC this long
TAKEN = ((TAKEN_HEADER, "1"),)   # the lane's HEADERS frame says what a worker's gRPC response header does


def _error(code: grpc.StatusCode, details: str, trailers: tuple = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


class _Connection:
    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since = 0.0

    @property
    def usable(self) -> bool:
        """Still open at both ends, and not idle for long: a worker that restarted closed its end."""
        return (not self.reader.at_eof() and not self.writer.is_closing()
                and time.monotonic() - self.idle_since < IDLE_S)

    def close(self) -> None:
        self.writer.transport.abort()   # no FIN handshake to wait for: the worker sees the call cancelled


class LaneChannel:
    """One worker's lane: where it is, and its idle connections."""

    def __init__(self, target: tuple[str, int] | str, tls: ClientTLS | None, grpc_generate: Callable,
                 pings: bool = False) -> None:
        self.target = target   # (host, port), or a Unix socket's path
        self.pings = pings     # the worker reads PING frames (ModelInfo.lane_pings): its calls are pinged
        self._calling: set[_Connection] = set()   # connections whose call runs, pinged
        self._ping_timer: asyncio.TimerHandle | None = None
        self._ssl = tls.ssl_context() if tls is not None and isinstance(target, tuple) else None
        self._server_name = (tls.server_name or None) if tls is not None else None
        self.grpc_generate = grpc_generate   # the worker's stub's Generate, when the lane cannot be reached
        self._idle: deque[_Connection] = deque()   # the most recently used on the right
        self._prune_timer: asyncio.TimerHandle | None = None
        self._down_until = 0.0
        self.failing = False   # its last connect failed: calls go over gRPC (`up` says when it is tried again)
        # Once a connect failed, one call at a time tries the lane again (the others go over
        # gRPC): against a port that drops packets each would wait CONNECT_TIMEOUT_S.
        self._probing = False
        self._tasks: set[asyncio.Task] = set()   # held: the loop keeps only weak references to tasks
        self.closed = False
        self.calls = self.fallbacks = 0

    @property
    def where(self) -> str:
        if isinstance(self.target, str):
            return f"unix://{self.target}"
        host, port = self.target
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def up(self) -> bool:
        """A call now tries it (not within RETRY_LANE_S of a failed connect)."""
        return not self.closed and time.monotonic() >= self._down_until

    @property
    def idle(self) -> int:
        """Connections kept for the next call."""
        return len(self._idle)

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None, metadata: tuple = ()) -> LaneCall:
        self.calls += 1
        return LaneCall(self, request, timeout, metadata)

    def close(self) -> None:
        """No connection is kept from now on; calls still running end on theirs (and are pinged
        while they run)."""
        self.closed = True
        for conn in self._idle:
            conn.close()
        self._idle.clear()
        if self._prune_timer is not None:
            self._prune_timer.cancel()

    def calling(self, conn: _Connection) -> None:
        """`conn` carries a call from now on: pinged until it is given back or closed."""
        if self.pings:
            self._calling.add(conn)
            if self._ping_timer is None:
                self._ping_timer = asyncio.get_running_loop().call_later(wire.PING_INTERVAL_S, self._ping)

    def _ping(self) -> None:
        """One PING on each connection whose call runs; again in PING_INTERVAL_S while any does."""
        self._ping_timer = None
        ping = wire.frame(wire.PING)
        for conn in list(self._calling):
            if conn.writer.is_closing():
                self._calling.discard(conn)
            else:
                conn.writer.write(ping)
        if self._calling:
            self._ping_timer = asyncio.get_running_loop().call_later(wire.PING_INTERVAL_S, self._ping)

    def _prune(self) -> None:
        """Closes the idle connections past IDLE_S or closed by the worker, oldest first (the
        newest are reused, so the oldest would never be looked at); again while some are kept."""
        self._prune_timer = None
        while self._idle and not self._idle[0].usable:
            self._idle.popleft().close()
        if self._idle and not self.closed:
            self._prune_timer = asyncio.get_running_loop().call_later(IDLE_S / 2, self._prune)

    async def take(self) -> tuple[_Connection, bool] | None:
        """An idle connection (and True), or a new one (False); None when the lane cannot be reached."""
        while self._idle:
            conn = self._idle.pop()
            if conn.usable:
                return conn, True
            conn.close()
        if not self.up:
            return None
        probe = self.failing
        if probe and self._probing:
            return None
        self._probing = probe
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                if isinstance(self.target, str):
                    reader, writer = await asyncio.open_unix_connection(self.target)
                else:
                    host, port = self.target
                    reader, writer = await asyncio.open_connection(
                        host, port, ssl=self._ssl, server_hostname=(self._server_name or host) if self._ssl else None)
        except (OSError, TimeoutError) as exc:
            self.unreachable(exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__)
            return None
        finally:
            if probe:
                self._probing = False
        if self.failing:
            log.warning("the lane at %s is reached again", self.where)
            self.failing = False
        wire.keep_alive(writer)
        writer.write(wire.MAGIC)
        return _Connection(reader, writer), False

    def unreachable(self, why: str) -> None:
        """Calls go over gRPC for RETRY_LANE_S."""
        if not self.failing:   # said once per outage, not by every call or retry that finds it down
            log.warning("the lane at %s cannot be reached (%s); calls go over gRPC, the lane tried again "
                        "every %g s", self.where, why, RETRY_LANE_S)
        self.failing = True
        self._down_until = time.monotonic() + RETRY_LANE_S

    def give_back(self, conn: _Connection) -> None:
        """A connection whose call ended with its status: kept for the next call."""
        self._calling.discard(conn)
        if not self.closed and len(self._idle) < MAX_IDLE and not conn.writer.is_closing():
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
            if self._prune_timer is None:
                self._prune_timer = asyncio.get_running_loop().call_later(IDLE_S / 2, self._prune)
        else:
            conn.close()

    def settle(self, conn: _Connection) -> None:
        """A call left right after its last sequence's end: the worker's status follows at once,
        and the connection is kept; anything else, or nothing within a second, and it is closed."""
        async def read_status() -> None:
            try:
                async with asyncio.timeout(1.0):
                    kind, _ = await wire.read_frame(conn.reader, wire.MAX_REPLY_BYTES)
            except (TimeoutError, asyncio.IncompleteReadError, OSError, wire.FramingError):
                kind = None
            if kind == wire.STATUS:
                self.give_back(conn)
            else:
                conn.close()
        self.spawn(read_status())

    def spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


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
        self._responses = self._stream()
        self._conn: _Connection | None = None
        self._grpc_call = None   # the call went over gRPC instead
        self._timer: asyncio.TimerHandle | None = None
        self._cancelled = self._expired = self._done = False
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
        self._took(None)
        if self._timer is not None:   # it would hold the call until the deadline
            self._timer.cancel()
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._last_finished and not self._reading:
                self._channel.settle(conn)
            else:
                conn.close()
        return True

    async def initial_metadata(self):
        """Once the worker took the call (its HEADERS frame); CancelledError if it ended without.
        Gone over gRPC, the gRPC call's own: asked once the call has ended, they may not have been
        passed on yet (when the headers and the status came together)."""
        if self._grpc_call is not None:
            return await self._grpc_call.initial_metadata()
        return await self._headers

    def __aiter__(self):
        return self._responses

    def _took(self, metadata: tuple | None = TAKEN) -> None:
        """The worker's response headers came (`metadata`), or the call ended without (None)."""
        if not self._headers.done():
            self._headers.set_result(metadata) if metadata is not None else self._headers.cancel()

    def _expire(self) -> None:
        """The deadline: the connection closes (the worker cancels the request), and the response
        being awaited ends DEADLINE_EXCEEDED."""
        self._expired = True
        if self._conn is not None:
            self._conn.close()

    def _send(self, conn: _Connection) -> None:
        self._conn = conn
        left_ms = 0 if self._deadline is None else \
            max(1, int((self._deadline - asyncio.get_running_loop().time()) * 1000))
        call = lane_pb.LaneCall(request=self._request, timeout_ms=left_ms, metadata=wire.metadata_pb(self._metadata),
                                ping_interval_ms=int(wire.PING_INTERVAL_S * 1000) if self._channel.pings else 0)
        conn.writer.write(wire.frame(wire.CALL, call.SerializeToString()))
        self._channel.calling(conn)

    async def _take(self) -> tuple[_Connection, bool] | None:
        """A connection for the call; CancelledError or the deadline's error if either came meanwhile."""
        taken = await self._channel.take()
        if (self._cancelled or self._expired) and taken is not None:
            self._channel.give_back(taken[0])
        if self._cancelled:
            raise asyncio.CancelledError
        if self._expired:
            raise _error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return taken

    async def _stream(self):
        channel = self._channel
        loop = asyncio.get_running_loop()
        try:
            if self._deadline is not None:   # one timer a call, not one a read
                self._timer = loop.call_at(self._deadline, self._expire)
            taken = await self._take()
            if taken is None:   # the lane cannot be reached: the call goes over gRPC
                async for response in self._over_grpc():
                    yield response
                return
            conn, reused = taken
            self._send(conn)
            heard = False   # a frame back: past that, a lost connection is the worker's failure
            over_grpc = False
            while not over_grpc:
                if self._cancelled:
                    raise asyncio.CancelledError
                if self._expired:   # (frames read before the connection closed may be waiting still)
                    raise _error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
                self._reading = True
                try:
                    kind, payload = await wire.read_frame(conn.reader, wire.MAX_REPLY_BYTES)
                    if kind == wire.MESSAGE:
                        message = pb.GenerateResponse.FromString(payload)
                    elif kind == wire.STATUS:
                        message = lane_pb.LaneStatus.FromString(payload)
                except (asyncio.IncompleteReadError, OSError, wire.FramingError, DecodeError) as exc:
                    # (OSError: TimeoutError among them, the kernel giving up on the peer)
                    conn.close()
                    self._conn = None
                    if self._cancelled:
                        raise asyncio.CancelledError from None
                    if self._expired:
                        raise _error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
                    if isinstance(exc, wire.FramingError) and exc.length:   # as gRPC refuses a message past its limit
                        raise _error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     wire.too_large(exc.length, wire.MAX_REPLY_BYTES)) from None
                    if not heard and reused and isinstance(exc, (asyncio.IncompleteReadError, ConnectionError)):
                        # an idle connection the worker had closed (restarted, or its lane server
                        # stopped) before the call reached it: once more on another
                        taken = await self._take()
                        if taken is None:   # the lane is down now: the call, never taken, goes over gRPC
                            over_grpc = True
                            continue
                        conn, reused = taken
                        self._send(conn)
                        continue
                    if not heard and isinstance(exc, (asyncio.IncompleteReadError, ConnectionError)):
                        # a new connection closed before a word (a proxy in front that finds no worker
                        # behind it): nothing was taken there; the call, and the next ones, go over gRPC
                        channel.unreachable("it closed a new connection before answering")
                        over_grpc = True
                        continue
                    # plain words for what a client may read: the exception's (errno text, a peer) is the log's
                    if isinstance(exc, asyncio.IncompleteReadError):
                        why, detail = "closed the connection", ""
                    else:
                        why = "lost the connection" if isinstance(exc, OSError) else \
                            "sent a frame this gateway cannot read"
                        detail = f" ({type(exc).__name__}: {exc})"
                    log.info("the lane at %s %s%s", channel.where, why, detail)
                    raise _error(grpc.StatusCode.UNAVAILABLE, f"the worker's lane {why}") from None
                finally:
                    self._reading = False
                heard = True
                if kind == wire.MESSAGE:
                    self._took()
                    self._last_finished = message.WhichOneof("event") == "finished"
                    yield message
                elif kind == wire.HEADERS:
                    self._took()
                elif kind == wire.STATUS:
                    self._conn = None
                    channel.give_back(conn)
                    code = wire.CODES.get(message.code, grpc.StatusCode.UNKNOWN)
                    if code != grpc.StatusCode.OK:
                        raise _error(code, message.details, wire.metadata_pairs(message.trailing_metadata))
                    return
                else:
                    raise _error(grpc.StatusCode.UNAVAILABLE, f"the worker's lane sent a frame of kind {kind}")
            async for response in self._over_grpc():
                yield response
        finally:
            self._done = True
            if self._timer is not None:
                self._timer.cancel()
            self._took(None)
            if self._conn is not None:   # left early (cancelled, past its deadline, failed): the worker cancels it
                self._conn.close()
                self._conn = None

    async def _over_grpc(self):
        """The call over the worker's gRPC port, with the deadline left (gRPC enforces it)."""
        self._channel.fallbacks += 1
        if self._timer is not None:
            self._timer.cancel()
        left = None if self._deadline is None else max(0.0, self._deadline - asyncio.get_running_loop().time())
        self._grpc_call = self._channel.grpc_generate(self._request, timeout=left, metadata=self._metadata)

        async def headers() -> None:
            try:   # (a call refused before it was taken has headers too, empty: grpc's trailers-only answer)
                metadata = tuple(await self._grpc_call.initial_metadata())
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                self._took(None)
                return
            self._took(metadata)
        self._channel.spawn(headers())
        async for response in self._grpc_call:
            yield response
