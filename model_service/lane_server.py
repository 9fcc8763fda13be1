"""The worker's side of the lane (protos/kvserve/inference/v1/lane.proto): Generate for a
gateway over length-prefixed frames, the same servicer behind it as behind gRPC (validation,
limits, tenants, drain, the client too slow, every status alike), with a hop that costs a
fraction of a gRPC call's.

Each call runs as a task; the gateway closing the connection (its client cancelled or left, or
the request moves) cancels it, as gRPC cancels a handler, and the servicer frees the request's
pages. A call's deadline is enforced here as gRPC's is. No API keys: the lane serves gateways
(--lane-listen is refused with --api-keys), over a private address or mutual TLS when it takes
tenants from metadata, as the gRPC port must.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable
from contextlib import aclosing
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError

from kvserve.inference.v1 import lane_pb2 as lane_pb
from kvserve.services.plumbing import lane_wire as wire
from kvserve.services.plumbing.address import CannotListen, parse_address, private_umask, remove_stale_socket
from kvserve.services.plumbing.grpc_server import LAST_MESSAGES_S
from kvserve.services.plumbing.tls import ServerTLS
from kvserve.services.plumbing.unexpected import told_as_incident

log = logging.getLogger(__name__)

OPENING_S = 10.0     # a connection must say it is the lane's (its TLS handshake too) within this long
IDLE_S = 120.0       # a connection idle between calls this long is closed (a gateway closes its own after 30 s)
# A frame's bytes must all come within this long of its header: a gateway writes a call whole, at
# once; a peer that stops one byte short would hold up to --max-request-bytes here.
FRAME_S = 10.0
DISCARD_S = 5.0      # the most time spent reading a refused frame's bytes
CLOSE_WAIT_S = 1.0
# Connections at once, far past what gateways hold: one per call the worker holds (at most
# --max-num-seqs + --max-waiting) and at most 256 idle ones per gateway (gateway/lane.py's
# MAX_IDLE). Past it a new connection is closed unanswered and the gateway sends its calls over
# gRPC for a while: a bound too low slows calls, it fails none. (No bound per address: one
# gateway alone may hold hundreds, and a host that takes every place only sends the others to gRPC.)
MAX_CONNECTIONS = 8192
REFUSALS_LOG_S = 60.0   # connections refused past the bound: said at most once this often
GENERATE = "/kvserve.inference.v1.Inference/Generate"


class _GatewayGone(Exception):
    """The connection failed under a call's write (reset, or the kernel gave up): nobody to tell."""


class _Abort(BaseException):
    """context.abort: the call ends with this status. A BaseException, as grpc's own: no
    `except Exception` in the servicer swallows it."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: tuple) -> None:
        super().__init__(details)
        self.code, self.details, self.trailers = code, details, trailers


class Outbox:
    """A call's frames, leaving in one write per turn of the event loop: the messages of one
    engine step and the status after them go out as one segment, not one each."""

    FLUSH_BYTES = 64 << 10   # past this much, written at once (and backpressure looked at)

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._parts: list[bytes] = []
        self._size = 0
        self._scheduled = False

    def put(self, data: bytes) -> None:
        self._parts.append(data)
        self._size += len(data)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self._parts and not self.writer.is_closing():
            self.writer.write(b"".join(self._parts))
        self._parts.clear()
        self._size = 0

    async def drain(self) -> None:
        """Waits while the gateway does not read (gRPC's flow control does the same)."""
        if self._size >= self.FLUSH_BYTES:
            self.flush()
        try:
            await self.writer.drain()
        except OSError as exc:   # ssl.SSLError and ETIMEDOUT's TimeoutError among them
            raise _GatewayGone from exc


class LaneContext:
    """What the servicer's Generate asks of its gRPC context, for a lane call."""

    def __init__(self, metadata: tuple, outbox: Outbox) -> None:
        self._metadata = metadata
        self._outbox = outbox
        self.headers_sent = False

    def invocation_metadata(self) -> tuple:
        return self._metadata

    async def send_initial_metadata(self, _metadata=()) -> None:
        if not self.headers_sent:
            self.headers_sent = True
            self._outbox.put(wire.frame(wire.HEADERS))

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple = ()) -> NoReturn:
        raise _Abort(code, details, tuple(trailing_metadata))


class LaneServer:
    def __init__(self, servicer, tls: ServerTLS | None, max_request_bytes: int,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.servicer = servicer
        self.max_connections = max_connections
        self.refused = 0   # connections closed unanswered, past max_connections
        self._refusals_said: float | None = None   # when the log last said so
        self._tls = tls
        self._ssl = tls.ssl_context() if tls is not None else None
        self._stop_tls: Callable[[], None] = lambda: None   # its certificate kept current while it listens
        self._call_frame_limit = max_request_bytes + wire.CALL_OVERHEAD
        self._max_request_bytes = max_request_bytes
        self._server: asyncio.base_events.Server | None = None
        self._connections: dict[asyncio.Task, asyncio.StreamWriter] = {}
        self._socket_inode: int | None = None   # its Unix socket file, removed on close only if still its own
        self.address = ""   # where it listens, once started: what ModelInfo.lane_address says

    async def start(self, listen: str) -> None:
        """Listens on `listen` (host:port, port 0 for a free one, or unix:PATH)."""
        address = parse_address(listen)
        tls = {"ssl": self._ssl, "ssl_handshake_timeout": OPENING_S} if self._ssl is not None else {}
        try:
            if address.is_unix:
                remove_stale_socket(address.unix_path)
                with private_umask():   # (bound, and listening, inside it)
                    self._server = await asyncio.start_unix_server(self._serve, address.unix_path)
                self._socket_inode = os.stat(address.unix_path).st_ino
                self.address = address.with_port(0)
            elif address.host in ("::", ""):   # every address, IPv4 too, as gRPC binds it (asyncio's is IPv6 only)
                self._server = await asyncio.start_server(self._serve, sock=_dual_stack(address.port), **tls)
                self.address = address.with_port(self._server.sockets[0].getsockname()[1])
            else:
                self._server = await asyncio.start_server(self._serve, address.host, address.port, **tls)
                self.address = address.with_port(self._server.sockets[0].getsockname()[1])
        except OSError as exc:
            raise CannotListen(f"--lane-listen: cannot listen on {listen}: {exc.strerror or exc}") from None
        if self._ssl is not None and not address.is_unix:
            self._stop_tls = self._tls.keep_current(self._ssl)

    async def close(self) -> None:
        """No new connections; the calls still running are cancelled and their connections cut
        (a drain has waited for them). Each is closed after what it still has to send (a gateway
        reading slowly: a call's last messages, its status and trailers), within LAST_MESSAGES_S
        where bytes wait, as gRPC's stop lets a call's last messages go. (Cut at once, a reset
        also threw away what the gateway's kernel had received and it had not read yet.)"""
        if self._server is None:
            return
        self._stop_tls()
        self._server.close()
        await asyncio.sleep(0)   # frames a call queued on its way out reach their socket first
        flushing = False
        for writer in list(self._connections.values()):
            flushing = flushing or bool(writer.transport.get_write_buffer_size())
            writer.close()
        tasks = list(self._connections)
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=LAST_MESSAGES_S if flushing else CLOSE_WAIT_S)
            for task in stuck:
                writer = self._connections.get(task)
                if writer is not None:
                    writer.transport.abort()   # a gateway that stopped reading altogether
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await asyncio.wait_for(self._server.wait_closed(), CLOSE_WAIT_S)
        except TimeoutError:
            pass
        if self._socket_inode is not None:
            path = parse_address(self.address).unix_path
            try:
                if os.stat(path).st_ino == self._socket_inode:   # not a successor's socket at the same path
                    os.unlink(path)
            except FileNotFoundError:
                pass
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: its calls one after another. While a call runs the gateway sends only
        pings, where the call asked for them, or closes the connection, which cancels the call:
        reading all the while, with one reader, sees it at once. A call whose pings stop is
        cancelled too: its gateway's host is gone, and the kernel would hold the connection
        (and the request decoding for nobody) until it gave up retransmitting."""
        if len(self._connections) >= self.max_connections:
            self._refuse(writer)
            return
        task = asyncio.current_task()
        self._connections[task] = writer
        loop = asyncio.get_running_loop()
        running: asyncio.Task | None = None
        quiet_s: float | None = None   # the running call's gateway silent this long is gone
        idle_timer: asyncio.Timeout | None = None   # the read's, while it waits

        def call_ended(_task) -> None:   # from now on the connection is idle: it has IDLE_S
            if idle_timer is not None:
                idle_timer.reschedule(loop.time() + IDLE_S)

        wire.keep_alive(writer, user_timeout=False)   # a gateway that stops reading is not gone
        try:
            async with asyncio.timeout(OPENING_S):
                if await reader.readexactly(len(wire.MAGIC)) != wire.MAGIC:
                    return
            while True:
                try:
                    calling = running is not None and not running.done()
                    try:
                        async with asyncio.timeout(quiet_s if calling else IDLE_S) as idle_timer:
                            waited = idle_timer
                            kind, payload = await wire.read_frame(reader, self._call_frame_limit, FRAME_S)
                    finally:
                        idle_timer = None
                except TimeoutError:
                    if running is not None and not running.done() and waited.expired():
                        log.info("a gateway sent no ping for %g s: its call is cancelled", quiet_s)
                    return
                except wire.FramingError as exc:
                    if running is not None:
                        await running
                    writer.write(self._too_large(exc.length))
                    await _discard(reader, exc.length)   # read, so that the status is not lost to a reset
                    return
                if kind == wire.PING:   # (one may cross the call's status: harmless between calls)
                    continue
                if kind != wire.CALL:
                    return
                if running is not None:   # sent before the last one's status: it waits its turn
                    await running
                try:
                    call = lane_pb.LaneCall.FromString(payload)
                except DecodeError:
                    call = None
                quiet_s = None if call is None or not call.ping_interval_ms else \
                    wire.QUIET_PINGS * max(call.ping_interval_ms, wire.MIN_PING_INTERVAL_MS) / 1000
                running = asyncio.ensure_future(self._call(call, len(payload), writer))
                running.add_done_callback(call_ended)
        except (asyncio.IncompleteReadError, OSError, ssl.SSLError):
            pass   # the gateway closed the connection, went away, left it idle or stopped mid-frame: nothing to tell it
        except asyncio.CancelledError:
            pass   # closing: asyncio's server callback reads a cancelled task's exception (and logs it)
        except Exception as exc:   # a bug: logged, the connection closed
            log.error("lane connection failed", exc_info=exc)
        finally:
            if running is not None and not running.done():
                running.cancel()
            if running is not None:
                await asyncio.gather(running, return_exceptions=True)
            self._connections.pop(task, None)
            writer.close()

    def _refuse(self, writer: asyncio.StreamWriter) -> None:
        """A connection past max_connections, closed unanswered: a gateway takes that for a lane
        it cannot reach and sends its calls over gRPC meanwhile."""
        self.refused += 1
        now = time.monotonic()
        if self._refusals_said is None or now - self._refusals_said >= REFUSALS_LOG_S:
            self._refusals_said = now
            peer = writer.get_extra_info("peername")
            log.warning("the lane refuses new connections: %d are open, as many as it takes; the calls go over "
                        "gRPC meanwhile (%d refused so far, the latest from %s)", len(self._connections),
                        self.refused, peer[0] if isinstance(peer, tuple) else "this host")
        writer.transport.abort()

    def _too_large(self, size: int) -> bytes:
        return wire.status_frame(grpc.StatusCode.RESOURCE_EXHAUSTED, wire.too_large(size, self._max_request_bytes))

    async def _call(self, call: lane_pb.LaneCall | None, frame_bytes: int, writer: asyncio.StreamWriter) -> None:
        """`call` None: its frame's bytes were not a LaneCall."""
        outbox = Outbox(writer)
        if call is None:
            outbox.put(wire.status_frame(grpc.StatusCode.INVALID_ARGUMENT,
                                         "the call's bytes are not a kvserve.inference.v1.LaneCall"))
            return
        # as the gRPC port refuses it; the request's size is walked only when its frame could hold one past the limit
        if frame_bytes > self._max_request_bytes and (size := call.request.ByteSize()) > self._max_request_bytes:
            outbox.put(self._too_large(size))
            return
        context = LaneContext(wire.metadata_pairs(call.metadata), outbox)
        code, details, trailers = grpc.StatusCode.OK, "", ()
        try:
            async with asyncio.timeout(call.timeout_ms / 1000 if call.timeout_ms else None) as deadline:
                async with aclosing(self.servicer.Generate(call.request, context)) as responses:
                    async for response in responses:
                        await context.send_initial_metadata()   # with the first message, as gRPC sends them
                        outbox.put(wire.frame(wire.MESSAGE, response.SerializeToString()))
                        await outbox.drain()
        except _Abort as abort:
            code, details, trailers = abort.code, abort.details, abort.trailers
        except _GatewayGone:
            return   # the gateway went away mid-stream
        except Exception as exc:
            if isinstance(exc, TimeoutError) and deadline.expired():
                code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
            else:   # a bug, the servicer's own OSError too: told as on the gRPC port, never as its repr
                code, details = grpc.StatusCode.INTERNAL, told_as_incident(GENERATE, exc)
        outbox.put(wire.status_frame(code, details, trailers))


async def _discard(reader: asyncio.StreamReader, length: int) -> None:
    """Reads and drops a refused frame's bytes, for at most DISCARD_S: closing with them unread
    would reset the connection, and the gateway could lose the status sent before."""
    try:
        async with asyncio.timeout(DISCARD_S):
            while length > 0:
                chunk = await reader.read(min(length, 1 << 16))
                if not chunk:
                    return
                length -= len(chunk)
    except (TimeoutError, OSError):
        pass


def _dual_stack(port: int) -> socket.socket:
    """A listening socket on every IPv6 and IPv4 address."""
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", port))
    except OSError:
        sock.close()
        raise
    return sock
