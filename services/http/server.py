"""Serving the HTTP front with uvicorn inside the server's own asyncio loop, on a socket bound
here (a busy port is a sentence, not uvicorn's exit), over TLS when the server has a certificate.

    front = await HttpFront.start("127.0.0.1:8000", running.local_channel())
    ...
    await front.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.services.http.app import make_app
from kvserve.services.http.translate import Limits
from kvserve.services.plumbing.address import CannotListen, parse_address
from kvserve.services.plumbing.tls import ServerTLS

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield   # the process's own signal handling drains it (wait_for_signal), not uvicorn's


HEADERS_TIMEOUT_S = 30.0   # from a connection's start, or a request's first byte, to its last header
HTTP_STOP_S = 10   # what stop() waits for the requests in flight (the server drained before it)
DRAIN_END_S = 30.0   # past a drain's grace: its streams' ends and last messages (begin_stop; stop() cuts it)


class _HeadersInTime(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection that is not in a request and has not
    sent a whole request head within HEADERS_TIMEOUT_S: uvicorn times out only the idle wait after
    a response, so a client that opens connections and sends nothing, or a header a byte at a
    time, held each one (its socket and memory) forever."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_due = self.loop.call_later(HEADERS_TIMEOUT_S, self._too_slow)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        in_request = self.cycle is not None and not self.cycle.response_complete
        if in_request and self._head_due is not None:
            self._head_due.cancel()
            self._head_due = None
        elif not in_request and self._head_due is None:   # the first bytes of the next request
            self._head_due = self.loop.call_later(HEADERS_TIMEOUT_S, self._too_slow)

    def connection_lost(self, exc) -> None:
        if self._head_due is not None:
            self._head_due.cancel()
            self._head_due = None
        super().connection_lost(exc)

    def _too_slow(self) -> None:
        self._head_due = None
        if not (self.cycle is not None and not self.cycle.response_complete):
            self.transport.close()


class HttpFront:
    def __init__(self, server: _Server, task: asyncio.Task, channel, address: str,
                 stop_tls: Callable[[], None] = lambda: None) -> None:
        self.server, self.task, self.channel, self.address = server, task, channel, address
        self._stop_tls = stop_tls   # what keeps its certificate current (tls.py)

    @classmethod
    async def start(cls, listen: str, channel, tls: ServerTLS | None = None,
                    max_body_bytes: int = 8 << 20, keys=None, allowed_origins: list[str] | None = None,
                    limits: Limits | None = None,
                    answered: Callable[[str, int], None] = lambda _route, _status: None) -> HttpFront:
        """Serves on `listen` (host:port; 0 picks a port), calling the Inference service through
        `channel` (this process's server's local_channel(): its handlers behind its
        interceptors, no socket); stop() ends it. `limits`: Limits.of(the server's config).
        `answered(route, status)`: each answer, for the server's metrics (metrics_server.http_answers)."""
        address = parse_address(listen)
        if address.is_unix:
            raise ValueError(f"--http-listen must be host:port, got {listen!r}")
        family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: without it a response's headers and body go in two
        # segments and the second waits for the client's delayed ACK (~40 ms on Linux) on every
        # keep-alive request.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((address.host, address.port))
        except OSError as exc:   # in use, or not permitted: as for every listener, no restart helps
            sock.close()
            raise CannotListen(f"cannot serve HTTP on {listen}: {exc.strerror or exc}") from None
        sock.listen(2048)
        sock.setblocking(False)
        # log_config=None: uvicorn's records go through the process's logging (its format, and the
        # filter that keeps what clients do out of the log: logging_setup.py), not its own handlers
        app = make_app(channel, max_body_bytes, keys, allowed_origins, limits, answered)
        config = uvicorn.Config(app, log_level="warning", log_config=None, lifespan="off",
                                access_log=False, timeout_graceful_shutdown=5, http=_HeadersInTime,
                                **(_tls_options(tls) if tls is not None else {}))
        server = _Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]), name="http front")
        while not server.started:
            if task.done():
                sock.close()
                raise ValueError(f"the HTTP front on {listen} did not start")
            await asyncio.sleep(0.01)
        bound = address.with_port(sock.getsockname()[1])
        log.info("OpenAI-compatible HTTP on http%s://%s", "s" if tls else "", bound)
        # uvicorn made its context from the files at start: the same context takes them again
        stop_tls = tls.keep_current(server.config.ssl) if tls is not None and server.config.ssl else (lambda: None)
        return cls(server, task, channel, bound, stop_tls)

    def begin_stop(self, grace_s: float) -> None:
        """A drain's start, HTTP's GOAWAY: the port closes, idle keep-alive connections are closed
        and busy ones once their response is out, so a client's next request opens a connection
        that reaches another replica where this one would answer 503 until it stopped; requests in
        flight get `grace_s` and the drain's end (stop() then bounds what is left)."""
        self.server.config.timeout_graceful_shutdown = grace_s + DRAIN_END_S
        self.server.should_exit = True

    async def stop(self) -> None:
        """Requests still running after HTTP_STOP_S (a client that stopped reading its stream)
        are cancelled, their calls with them, and their connections closed: nothing of the front
        is left for the process's exit to find."""
        self._stop_tls()
        self.server.should_exit = True
        done, _ = await asyncio.wait({self.task}, timeout=HTTP_STOP_S)
        if not done:
            state = self.server.server_state
            log.warning("the HTTP front stops with %d requests still running: they are cancelled", len(state.tasks))
            self.server.force_exit = True
            for connection in list(state.connections):   # a request sees its client gone and ends
                connection.transport.abort()   # (close() would wait on a client that stopped reading)
            if state.tasks:
                await asyncio.wait(set(state.tasks), timeout=1)
            for task in list(state.tasks):   # one that did not
                task.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self.task, 5)
        await self.channel.close()


def _tls_options(tls: ServerTLS) -> dict:
    options = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
    if tls.client_ca:
        options.update(ssl_ca_certs=tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options
