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
import ssl
from contextlib import aclosing
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError

from kvserve.inference.v1 import lane_pb2 as lane_pb
from kvserve.model_service.engine.errors import InternalError
from kvserve.services.plumbing import lane_wire as wire
from kvserve.services.plumbing.address import CannotListen, parse_address, remove_stale_socket
from kvserve.services.plumbing.tls import ServerTLS

log = logging.getLogger(__name__)


class _Abort(BaseException):
    """context.abort: the call ends with this status. A BaseException, as grpc's own: no
    `except Exception` in the servicer swallows it."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: tuple) -> None:
        super().__init__(details)
        self.code, self.details, self.trailers = code, details, trailers


class LaneContext:
    """What the servicer's Generate asks of its gRPC context, for a lane call."""

    def __init__(self, metadata: tuple, writer: asyncio.StreamWriter) -> None:
        self._metadata = metadata
        self._writer = writer
        self.headers_sent = False

    def invocation_metadata(self) -> tuple:
        return self._metadata

    async def send_initial_metadata(self, _metadata=()) -> None:
        if not self.headers_sent:
            self.headers_sent = True
            self._writer.write(wire.frame(wire.HEADERS))

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple = ()) -> NoReturn:
        raise _Abort(code, details, tuple(trailing_metadata))


class LaneServer:
    def __init__(self, servicer, tls: ServerTLS | None, max_request_bytes: int) -> None:
        self.servicer = servicer
        self._ssl = wire.server_ssl(tls)
        self._limit = max_request_bytes + wire.CALL_OVERHEAD
        self._max_request_bytes = max_request_bytes
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self.address = ""   # where it listens, once started: what ModelInfo.lane_address says

    async def start(self, listen: str) -> None:
        """Listens on `listen` (host:port, port 0 for a free one, or unix:PATH)."""
        address = parse_address(listen)
        try:
            if address.is_unix:
                remove_stale_socket(address.unix_path)
                self._server = await asyncio.start_unix_server(self._serve, address.unix_path)
                self.address = address.with_port(0)
            else:
                self._server = await asyncio.start_server(self._serve, address.host or None, address.port,
                                                          ssl=self._ssl)
                self.address = address.with_port(self._server.sockets[0].getsockname()[1])
        except OSError as exc:
            raise CannotListen(f"--lane-listen: cannot listen on {listen}: {exc.strerror or exc}") from None

    async def close(self) -> None:
        """No new connections; the calls still running are cancelled (a drain has waited for them)."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        path = parse_address(self.address).unix_path if self.address.startswith("unix:") else ""
        if path and os.path.exists(path):
            os.unlink(path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: its calls one after another. The gateway sends nothing while a call runs
        but closing the connection, which cancels the call; reading all the while, with one reader,
        sees it at once."""
        task = asyncio.current_task()
        self._connections.add(task)
        running: asyncio.Task | None = None
        wire.keep_alive(writer)
        try:
            if await reader.readexactly(len(wire.MAGIC)) != wire.MAGIC:
                return
            while True:
                try:
                    kind, payload = await wire.read_frame(reader, self._limit)
                except wire.FramingError as exc:
                    if running is not None:
                        await running
                    writer.write(self._too_large(exc.length))
                    await writer.drain()
                    return
                if kind != wire.CALL:
                    return
                if running is not None:   # sent before the last one's status: it waits its turn
                    await running
                running = asyncio.ensure_future(self._call(payload, writer))
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, ssl.SSLError):
            pass   # the gateway closed the connection, or went away: nothing to tell it
        finally:
            if running is not None and not running.done():
                running.cancel()
            if running is not None:
                await asyncio.gather(running, return_exceptions=True)
            self._connections.discard(task)
            writer.close()

    def _too_large(self, size: int) -> bytes:
        # gRPC's own words for it, which a gateway reads (relay._too_large)
        return wire.status_frame(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"Received message larger than max ({size} vs. {self._max_request_bytes})")

    async def _call(self, payload: bytes, writer: asyncio.StreamWriter) -> None:
        try:
            call = lane_pb.LaneCall.FromString(payload)
        except DecodeError:
            writer.write(wire.status_frame(grpc.StatusCode.INVALID_ARGUMENT,
                                           "the call's bytes are not a kvserve.inference.v1.LaneCall"))
            return
        size = call.request.ByteSize()
        if size > self._max_request_bytes:   # as the gRPC port refuses it
            writer.write(self._too_large(size))
            return
        context = LaneContext(tuple((m.key, m.value) for m in call.metadata), writer)
        code, details, trailers = grpc.StatusCode.OK, "", ()
        try:
            async with asyncio.timeout(call.timeout_ms / 1000 if call.timeout_ms else None):
                async with aclosing(self.servicer.Generate(call.request, context)) as responses:
                    async for response in responses:
                        await context.send_initial_metadata()   # with the first message, as gRPC sends them
                        writer.write(wire.frame(wire.MESSAGE, response.SerializeToString()))
                        # a gateway that does not read holds the stream, as gRPC's flow control does
                        await writer.drain()
        except _Abort as abort:
            code, details, trailers = abort.code, abort.details, abort.trailers
        except TimeoutError:
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except (ConnectionError, ssl.SSLError):
            return   # the gateway went away mid-stream
        except Exception as exc:   # a bug: logged under an id, never shown as its repr
            error = InternalError("the lane call failed")
            log.error("lane call failed (incident %s)", error.incident, exc_info=exc)
            code, details = grpc.StatusCode.INTERNAL, str(error)
        writer.write(wire.status_frame(code, details, trailers))
        try:
            await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
