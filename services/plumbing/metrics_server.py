"""Prometheus text over HTTP (`--metrics-listen HOST:PORT`, path /metrics), one registry per
process: only kvserve's own series, so `kvserve up` can serve several processes' series at one
address without two of them claiming the same name.

    registry = CollectorRegistry()
    endpoint = serve_metrics("127.0.0.1:0", registry)
    endpoint.address   # "127.0.0.1:41234"
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from typing import TypeVar

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, GCCollector, PlatformCollector,
                               ProcessCollector, disable_created_metrics, generate_latest)
from prometheus_client.exposition import ThreadingWSGIServer

from kvserve.services.plumbing.address import CannotListen, parse_address

log = logging.getLogger(__name__)
T = TypeVar("T")
SCRAPE_TIMEOUT_S = 2.0   # well inside Prometheus's default scrape timeout (10 s)
# A scrape's call to another process (the model service's to its manager): half the scrape's, so
# that a peer that hangs costs its own series, not the whole scrape's (`kvserve up` gathers its
# children's in SCRAPE_TIMEOUT_S); a peer slower than this reads as not answering.
PEER_TIMEOUT_S = SCRAPE_TIMEOUT_S / 2
IDLE_TIMEOUT_S = 10.0    # a connection silent this long is closed
MAX_CONNECTIONS = 32     # served at once; more are closed as they come

disable_created_metrics()   # no `_created` series beside every counter and histogram

# Seconds: from a millisecond (a cached one-token reply) to ten minutes (a long generation).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
# Per token, finer: decode steps take milliseconds.
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                         0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


# The series every Prometheus client library serves of its own process, which stock dashboards
# and a leak's alert read: process_* (resident memory, CPU seconds, open files, start time),
# python_gc_* and python_info. Each server's registry holds them beside its `kvserve:` series.
PROCESS_SERIES_PREFIXES = ("process_", "python_")


def add_process_series(registry: CollectorRegistry) -> None:
    """The process's standard series (PROCESS_SERIES_PREFIXES) into `registry`: the library puts
    them in its global registry only, which no server here serves."""
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)


def http_answers(registry) -> Callable[[str, int], None]:
    """The HTTP front's answers as a counter of `registry`, by route (its template: a bounded set)
    and status: what (route, status) the front calls for each. Its refusals are answered before any
    gRPC call, so no other series sees them."""
    answers = Counter("kvserve:http_requests", "HTTP requests the OpenAI-compatible front answered, by route "
                      "and status code (a stream by the status it began with)", ["route", "status"], registry=registry)
    return lambda route, status: answers.labels(route, str(status)).inc()


@dataclass
class MetricsEndpoint:
    server: WSGIServer
    thread: threading.Thread
    address: str

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Quiet(WSGIRequestHandler):
    timeout = IDLE_TIMEOUT_S   # a connection that sends nothing lets go of its thread

    def log_message(self, format, *args) -> None:   # a line per scrape on stderr: no
        pass

    def handle(self) -> None:
        try:
            super().handle()
        except (TimeoutError, ConnectionError):   # went silent, or away: closed, nothing to report
            pass   # (socketserver printed a traceback for each)


class _Bounded(ThreadingWSGIServer):
    """A thread per connection, up to MAX_CONNECTIONS at once; past them a connection is closed
    at once (a scraper retries at its next interval), so idle sockets cannot pile up threads."""

    def __init__(self, *args, **kwargs) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def text_format(registry: CollectorRegistry):
    """The registry in Prometheus' text format, whatever the scrape's Accept header asks:
    prometheus_client's OpenMetrics output names the samples of a `kvserve:` family
    `kvserve_...` under a `# TYPE kvserve:...` line, so a Prometheus 2 scrape (which asks for
    OpenMetrics first) would store untyped series under other names than the documented ones."""
    def app(environ, start_response):
        body = generate_latest(registry)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
        return [body]
    return app


def only_metrics_path(app):
    """`app` at /metrics for GET and HEAD (HEAD without the body: a keep-alive client would read
    it as the next response); 404 elsewhere (prometheus_client answers every path with the
    series, so a probe or a scanner of any URL would read them and a typo'd scrape config would
    work), 405 for any other method."""
    def routed(environ, start_response):
        method = environ.get("REQUEST_METHOD", "GET")
        if environ.get("PATH_INFO", "") not in ("/metrics", "/metrics/"):
            status, body = "404 Not Found", b"not found: the metrics are at /metrics\n"
        elif method not in ("GET", "HEAD"):
            status, body = "405 Method Not Allowed", b"the metrics are read with GET\n"
        else:
            out = app(environ, start_response)
            return [] if method == "HEAD" else out
        headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
        if status.startswith("405"):
            headers.append(("Allow", "GET, HEAD"))
        start_response(status, headers)
        return [] if method == "HEAD" else [body]
    return routed


def serve_metrics(listen: str, registry: CollectorRegistry) -> MetricsEndpoint:
    """Serves `registry` at /metrics on `listen` (host:port; port 0 picks one) from a daemon
    thread, in plain HTTP (counts, never a prompt or a key). Raises ValueError for an address it
    cannot serve on, CannotListen where it cannot listen."""
    address = parse_address(listen)
    if address.is_unix:
        raise ValueError(f"--metrics-listen must be host:port (Prometheus scrapes over TCP), got {listen!r}")
    try:
        family = socket.getaddrinfo(address.host or None, address.port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("MetricsServer", (_Bounded,), {"address_family": family})
        server = make_server(address.host, address.port, only_metrics_path(text_format(registry)),
                             server_class, handler_class=_Quiet)
    except OSError as exc:   # in use, or not permitted: no restart helps
        raise CannotListen(f"cannot serve metrics on {listen}: {exc.strerror or exc}") from None
    thread = threading.Thread(target=server.serve_forever, name="kvserve-metrics", daemon=True)
    thread.start()
    endpoint = MetricsEndpoint(server, thread, address.with_port(server.server_port))
    log.info("metrics on http://%s/metrics", endpoint.address)
    return endpoint


def read_on_loop(loop: asyncio.AbstractEventLoop, read: Callable[[], T]) -> T:
    """read() run on `loop`'s thread, where the state it reads lives without a lock, waited for
    from the scrape's thread (at most SCRAPE_TIMEOUT_S)."""
    async def run() -> T:
        return read()
    return asyncio.run_coroutine_threadsafe(run(), loop).result(SCRAPE_TIMEOUT_S)
