"""The one way kvserve starts a gRPC server (asyncio, grpc.aio).

    running = await create_server("127.0.0.1:0", [ServiceSpec(add_fn, servicer, name)])
    running.address   # "127.0.0.1:43123": the real port when 0 was asked for
    await serve_until_signal(running.server, running.health)

Every server also serves grpc.health.v1.Health (each listed service and "" are
SERVING once started) and server reflection (grpc.reflection.v1alpha), so
grpcurl and Kubernetes `grpc:` probes work against any kvserve process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from concurrent import futures
from typing import Any, NamedTuple

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvserve.services.plumbing.address import (CannotListen, ListenAddress, parse_address, private_umask,
                                                remove_stale_socket)
from kvserve.services.plumbing.local_channel import HandlerRecorder, LocalChannel
from kvserve.services.plumbing.malformed import RefuseMalformed
from kvserve.services.plumbing.tls import ServerTLS
from kvserve.services.plumbing.unexpected import HideUnexpected

log = logging.getLogger(__name__)

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

# Step responses carry page ids for whole batches; 64 MiB leaves room for long
# prompts without letting one runaway message exhaust memory (gRPC default: 4 MiB).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

DEFAULT_OPTIONS: Mapping[str, int] = {
    "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
    "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
    # Ping quiet connections so a vanished or frozen client is noticed in ~40 s and its
    # requests end. gRPC core waits ping_timeout_ms for the answer, not keepalive_timeout_ms
    # (without it a frozen peer held its calls for 30 + 60 s; tests/service/test_keepalive.py).
    "grpc.keepalive_time_ms": 30_000,
    "grpc.keepalive_timeout_ms": 10_000,
    "grpc.http2.ping_timeout_ms": 10_000,
    "grpc.keepalive_permit_without_calls": 1,
    # Ping on while no data flows (gRPC stops after 2 by default): a client whose request waits
    # in a queue, quiet, was found frozen only much later.
    "grpc.http2.max_pings_without_data": 0,
    # Accept client keepalive pings this often without answering GOAWAY.
    "grpc.http2.min_ping_interval_without_data_ms": 10_000,
    # A second server on a busy port must fail to bind, not silently share it.
    "grpc.so_reuseport": 0,
}


class ServiceSpec(NamedTuple):
    """One service to serve; a plain (add_fn, servicer, name) tuple works too."""

    add_to_server: Callable[[Any, grpc.aio.Server], None]  # e.g. add_KVCacheManagerServicer_to_server
    servicer: object
    name: str  # full name, e.g. "kvserve.kvcache.v1.KVCacheManager"


class RunningServer(NamedTuple):
    """A started server, the address it really listens on (the first, when several),
    its health servicer, every address it listens on, and what a call from inside the process
    runs (local_channel)."""

    server: grpc.aio.Server
    address: str
    health: health_aio.HealthServicer
    addresses: tuple[str, ...] = ()
    handlers: tuple = ()       # the services' and health's method handlers
    interceptors: tuple = ()   # in the order a call meets them
    probe_free: asyncio.Event | None = None   # --health-listen's port closes once it is set and the server stopped

    def local_channel(self) -> LocalChannel:
        """A channel to this server from inside its process: its handlers behind its
        interceptors, no socket (local_channel.py)."""
        return LocalChannel(self.handlers, self.interceptors)


class BindError(CannotListen):
    """The server could not listen on the requested address."""


async def create_server(
    address: str | Sequence[str],
    services: Iterable[ServiceSpec | tuple[Callable[[Any, grpc.aio.Server], None], object, str]],
    *,
    max_workers: int | None = None,
    options: Mapping[str, Any] | None = None,
    tls: ServerTLS | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    health_listen: str = "",
) -> RunningServer:
    """Build, bind and start a server for ``services`` on ``address`` (or on each of
    several addresses, e.g. TCP for the world and a Unix socket for a sidecar).

    ``max_workers`` sizes the thread pool that runs non-async handlers (None:
    gRPC's default); ``options`` override DEFAULT_OPTIONS key by key; ``tls``
    serves every TCP address over TLS (Unix sockets stay plaintext: tls.py);
    ``interceptors`` see every call first (auth.py), then a request whose bytes do not parse
    is refused with INVALID_ARGUMENT (malformed.py), and a handler's unexpected failure is
    INTERNAL with an incident id, not its repr (unexpected.py); ``health_listen`` adds a
    plaintext port serving grpc.health.v1 alone, for Kubernetes probes (which
    cannot speak TLS), stopped with the server. Raises
    ValueError for a malformed address or service list, BindError when the
    address cannot be bound.
    """
    wanted = [address] if isinstance(address, str) else list(address)
    if not wanted:
        raise ValueError("no address to listen on")
    listens = [parse_address(a) for a in wanted]
    probe_listen = parse_address(health_listen) if health_listen else None
    specs = _check_services(services)
    pool = futures.ThreadPoolExecutor(max_workers) if max_workers else None
    chain = (*interceptors, RefuseMalformed(), HideUnexpected())
    server = grpc.aio.server(
        migration_thread_pool=pool,
        options=list({**DEFAULT_OPTIONS, **(options or {})}.items()),
        interceptors=list(chain),
    )
    recorder = HandlerRecorder()   # the same handlers again, for calls from inside the process
    for spec in specs:
        spec.add_to_server(spec.servicer, server)
        spec.add_to_server(spec.servicer, recorder)
    health = await _add_health(server, [spec.name for spec in specs])
    health_pb2_grpc.add_HealthServicer_to_server(health, recorder)
    reflection.enable_server_reflection(
        [*(spec.name for spec in specs), HEALTH_SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    bound = []
    for listen, text in zip(listens, wanted):
        bound.append(listen.with_port(await _bind(server, listen, text, tls)))
    await server.start()
    if probe_listen is not None:
        probe_free = asyncio.Event()
        probe_free.set()
        await _serve_health_alone(server, health, probe_listen, health_listen, probe_free)
    else:
        probe_free = None
    log.info("serving %s on %s", ", ".join(s.name for s in specs) or "health only", ", ".join(bound))
    return RunningServer(server, bound[0], health, tuple(bound), tuple(recorder.handlers), chain, probe_free)


async def serve_until_signal(
    server: grpc.aio.Server,
    health: health_aio.HealthServicer,
    grace_s: float = 5.0,
    on_stop: Callable[[], None] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT (or the server stops), then stop gracefully.

    ``on_stop`` runs first, e.g. to end long-lived streams that would otherwise
    hold the drain for the whole grace period.

    Must run in the main thread (asyncio signal handlers). A second Ctrl-C cuts a slow drain
    short (wait_for_signal).
    """
    hurry = await wait_for_signal(server, grace_s)
    if on_stop is not None:
        on_stop()
    await stop_gracefully(server, health, grace_s, hurry)


# The last stop of a draining server: every handler has returned, but a stream's last messages
# (its ending status among them) may still sit behind what a slow client has not read yet. The
# stop waits only while they go out, so a generous bound costs nothing when none is slow.
LAST_MESSAGES_S = 5.0


async def wait_for_signal(server: grpc.aio.Server, grace_s: float | None = None) -> asyncio.Event:
    """Returns on SIGTERM or SIGINT, or when the server stops. A server that drains in its own way
    (the model service, the gateway) starts from here; `grace_s` is for the log. The event it
    returns is set by SIGINT during the drain (Ctrl-C twice: stop now): drains end their grace
    periods at once when it is (drain_wait, stop_gracefully), and the process exits cleanly."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    hurry = asyncio.Event()
    received: list[signal.Signals] = []
    watched = (signal.SIGTERM, signal.SIGINT)
    for sig in watched:
        loop.add_signal_handler(sig, lambda s=sig: (received.append(s), stop.set()))
    # shield: cancelling a bare wait_for_termination() cancels grpc's own
    # shutdown future, and server.stop() afterwards would then raise CancelledError.
    terminated = asyncio.shield(server.wait_for_termination())
    waiters = [asyncio.ensure_future(stop.wait()), terminated]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        for sig in watched:
            loop.remove_signal_handler(sig)
    if received:
        # SIGTERM again (a supervisor's second, Kubernetes' after a preStop hook) must not cut the
        # drain short: with no handler it would end the process at once, every stream reset.
        loop.add_signal_handler(signal.SIGTERM, log.info, "SIGTERM again: already draining")
        # SIGINT again does, through the drain: Python's own KeyboardInterrupt would tear the
        # loop down under the server (a traceback, and streams ended CANCELLED with no reason).
        loop.add_signal_handler(signal.SIGINT, lambda: (log.warning("SIGINT again: stopping now"), hurry.set()))
        if grace_s is not None:
            log.info("%s received: draining for up to %.1f s", received[0].name, grace_s)
    return hurry


async def drain_wait(busy: Callable[[], bool], seconds: float, hurry: asyncio.Event | None = None) -> None:
    """Until busy() is false, `seconds` have passed or `hurry` is set."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while busy() and loop.time() < deadline and not (hurry is not None and hurry.is_set()):
        await asyncio.sleep(0.02)


# What the drain's first stop gives the calls in flight: longer than any drain, whose own last
# stop (stop_server) then cuts it to what the drain has left.
_UNTIL_DRAINED_S = 3600.0


@contextlib.asynccontextmanager
async def goaway_drain(running: RunningServer) -> AsyncIterator[None]:
    """A drain's frame. On entering, the server stops listening and tells every connection
    GOAWAY, so a client holding one sends its next call elsewhere (gRPC retries a call refused
    so, unseen) where answering it UNAVAILABLE would have failed it; calls in flight go on, for
    the drain to end (stop_server inside cuts their time). Health probes keep their own port
    (--health-listen) until the drain leaves the frame: work that is no gRPC call (a lane's
    streams, HTTP requests) may outlast the server's last call, and a probe refused meanwhile
    would read as a dead process."""
    if running.probe_free is not None:
        running.probe_free.clear()
    stopping = asyncio.ensure_future(running.server.stop(_UNTIL_DRAINED_S))
    try:
        yield
        await stopping
    except BaseException:   # the drain failed or was cancelled: the server stops now, not in an hour
        await running.server.stop(0)   # (a second stop with less grace cuts the first)
        raise
    finally:
        if running.probe_free is not None:
            running.probe_free.set()


async def stop_server(server: grpc.aio.Server, grace_s: float | None, hurry: asyncio.Event | None = None) -> None:
    """server.stop(grace_s), cut to no grace when `hurry` is set meanwhile (every call left then
    ends UNAVAILABLE)."""
    stopping = asyncio.ensure_future(server.stop(grace_s))
    if hurry is not None:
        hurried = asyncio.ensure_future(hurry.wait())
        await asyncio.wait({stopping, hurried}, return_when=asyncio.FIRST_COMPLETED)
        hurried.cancel()
        if not stopping.done():
            await server.stop(0)   # a second stop with less grace shortens the first
    await stopping


async def stop_gracefully(
    server: grpc.aio.Server, health: health_aio.HealthServicer, grace_s: float = 5.0,
    hurry: asyncio.Event | None = None,
) -> None:
    """Report NOT_SERVING first (so load balancers and probes move away), then stop.

    In-flight calls get ``grace_s`` seconds to finish (none once ``hurry`` is set); new calls
    are refused.
    """
    await health.enter_graceful_shutdown()
    await stop_server(server, grace_s, hurry)


def _check_services(services: Iterable[Any]) -> list[ServiceSpec]:
    specs = [ServiceSpec(*service) for service in services]
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"a service is listed twice: {names}")
    pool = descriptor_pool.Default()
    for name in names:
        try:
            pool.FindServiceByName(name)
        except KeyError:
            # Reflection and health are keyed by this name: a typo would go unnoticed.
            raise ValueError(
                f"unknown gRPC service {name!r}: use the full name (package.Service) "
                "and import its _pb2 module first"
            ) from None
    return specs


_probe_watchers: set[asyncio.Task] = set()


async def _serve_health_alone(main: grpc.aio.Server, health: health_aio.HealthServicer, listen: ListenAddress,
                              address: str, free: asyncio.Event) -> None:
    """The same health servicer (so the same statuses) on a plaintext port of its own, stopped
    once the main server has stopped and no drain holds it (`free`)."""
    probe = grpc.aio.server(options=list(DEFAULT_OPTIONS.items()),   # no port sharing, as for the main one
                            interceptors=[RefuseMalformed()])
    health_pb2_grpc.add_HealthServicer_to_server(health, probe)
    try:
        await _bind(probe, listen, address, None)
    except BindError:
        await main.stop(None)
        raise
    await probe.start()

    async def stop_with_main() -> None:
        await main.wait_for_termination()
        await free.wait()
        await probe.stop(None)

    task = asyncio.create_task(stop_with_main(), name="health port")
    _probe_watchers.add(task)
    task.add_done_callback(_probe_watchers.discard)
    log.info("grpc.health.v1 alone, plaintext, on %s", address)


async def _add_health(server: grpc.aio.Server, names: list[str]) -> health_aio.HealthServicer:
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in ("", *names):  # "" is the whole server, what a bare `grpc:` probe asks
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return health


async def _bind(server: grpc.aio.Server, listen: ListenAddress, address: str, tls: ServerTLS | None) -> int:
    if listen.is_unix:
        remove_stale_socket(listen.unix_path)
    try:
        if tls is not None and not listen.is_unix:
            port = server.add_secure_port(listen.grpc_target(), tls.credentials())
        else:
            with private_umask() if listen.is_unix else contextlib.nullcontext():
                port = server.add_insecure_port(listen.grpc_target())
    except RuntimeError as exc:  # grpcio raises here; older versions returned 0
        port, cause = 0, exc
    else:
        cause = None
    if port == 0:
        await server.stop(None)
        folder = os.path.dirname(listen.unix_path) if listen.is_unix else ""
        if folder and not os.path.isdir(folder):
            raise BindError(f"cannot listen on {address}: the directory {folder} does not exist") from cause
        raise BindError(f"cannot listen on {address} (address in use or not permitted)") from cause
    return port
