"""Starts the model service: build the stack, start the engine, serve Inference."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kvserve.kvcache.v1 import kvcache_pb2_grpc as kv_pb_grpc
from kvserve.model_service import assembly
from kvserve.model_service.cache_events import SERVICE_NAME as EVENTS_SERVICE_NAME, CacheEventsServicer
from kvserve.model_service.event_relay import EventRelay
from kvserve.model_service.config import ModelServiceConfig
from kvserve.model_service.servicer import SERVICE_NAME, InferenceServicer, model_labels
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.model_service.engine.errors import Unavailable
from kvserve.model_service.health import NOT_SERVING, HealthReporter
from kvserve.model_service.lane_server import LaneServer
from kvserve.model_service.metrics import ServiceMetrics
from kvserve.services.plumbing import server_flags
from kvserve.services.plumbing.api_keys import ApiKeys, read_token
from kvserve.services.plumbing.auth import Refuse, RequireApiKey
from kvserve.services.http.server import HttpFront
from kvserve.services.http.translate import Limits
from kvserve.services.plumbing.metrics_server import serve_metrics
from kvserve.services.plumbing.grpc_server import (LAST_MESSAGES_S, RunningServer, ServiceSpec, create_server as _create,
                                                   drain_wait, goaway_drain, stop_server, wait_for_signal)

log = logging.getLogger(__name__)
T = TypeVar("T")

EVENTS_REFUSED = ("this model service checks API keys (--api-keys): it serves clients, not gateways, and does not "
                  "publish its cache's page hashes; a gateway follows workers started with --trust-tenant-metadata")


async def create_server(config: ModelServiceConfig) -> tuple[RunningServer, InferenceServicer]:
    """A started server (the engine running) on config.listen; port 0 picks a free port."""
    # The engine hands each step's events to this loop at once, through the relay.
    config.check_files()
    relay = EventRelay(asyncio.get_running_loop())
    # torch runs on a thread that ends once built (assembly.build_on_a_thread_that_ends says why)
    stack = await _on_a_daemon_thread(assembly.build, config, relay.flush)
    servicer = running = None
    try:
        await _on_a_daemon_thread(stack.engine.start, config.kvcache_timeout_s)
        keys = ApiKeys(config.api_keys) if config.api_keys else None
        server_flags.warn_keys_in_plaintext(config.api_keys, config.tls_cert, config.listen, config.http_listen)
        servicer = InferenceServicer(stack, relay, ServiceMetrics(stack.engine, stack.kv.stats, model_labels(stack)),
                                     keys)
        if config.metrics_listen:
            servicer.metrics_endpoint = serve_metrics(config.metrics_listen, servicer.metrics.registry)
        servicer.cache_events = CacheEventsServicer(config.kvcache, config.kvcache_tls(),
                                                    read_token(config.kvcache_token_file))
        specs = [ServiceSpec(pb_grpc.add_InferenceServicer_to_server, servicer, SERVICE_NAME),
                 ServiceSpec(kv_pb_grpc.add_KVCacheEventsServicer_to_server, servicer.cache_events,
                             EVENTS_SERVICE_NAME)]
        # A front that checks keys serves no cache events: their page hashes would let one tenant
        # test a guess at another's prompts. A gateway follows workers, which check no keys.
        guards = [RequireApiKey(keys, {SERVICE_NAME}), Refuse(EVENTS_SERVICE_NAME, EVENTS_REFUSED)] if keys else []
        running = await _create(config.listen, specs, options={
            "grpc.max_receive_message_length": config.max_request_bytes}, tls=config.server_tls(), interceptors=guards,
            health_listen=config.health_listen)
        # The events relay the manager's stream: down, draining or stalled with the Inference service;
        # a server that checks keys refuses every events call, so says so for good.
        servicer.health = HealthReporter(running.health, [SERVICE_NAME] if keys else [SERVICE_NAME, EVENTS_SERVICE_NAME],
                                         stack.engine)
        if keys:
            await running.health.set(EVENTS_SERVICE_NAME, NOT_SERVING)
        servicer.health.start()
        if config.lane_listen:
            lane = LaneServer(servicer, config.server_tls(), config.max_request_bytes)
            await lane.start(config.lane_listen)
            servicer.lane = lane
        if config.http_listen:   # calls this server in-process, the caller's key as metadata
            servicer.http_front = await HttpFront.start(config.http_listen, running.local_channel(),
                                                        config.server_tls(), config.max_request_bytes, keys,
                                                        server_flags.allowed_origins(config.http_allowed_origins),
                                                        Limits.of(config), servicer.metrics.http_answered)
        return running, servicer
    except Exception:   # nothing half-started outlives the failure
        if running is not None:
            await running.server.stop(None)
        if servicer is not None and servicer.lane is not None:
            await servicer.lane.close()
        if servicer is not None:
            if servicer.health is not None:
                await servicer.health.stop()
            if servicer.cache_events is not None:
                await servicer.cache_events.close()
            servicer.close()
        stack.engine.stop()
        stack.kv.close()
        raise


async def _on_a_daemon_thread(fn: Callable[..., T], *args) -> T:
    """fn(*args) on a thread that does not hold the process up, and has ended when this returns.
    asyncio.to_thread's executor is joined before asyncio.run returns: Ctrl-C during a start that
    waits (for a manager, up to --kvcache-timeout; for a large checkpoint to load) did nothing
    until the wait was over."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result, error) -> None:
        if not done.done():   # cancelled meanwhile: the process is on its way out
            done.set_exception(error) if error is not None else done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:   # raised again on the loop's thread
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:   # the loop has closed: nobody is waiting
            pass

    thread = threading.Thread(target=run, name=f"kvserve-{getattr(fn, '__name__', 'start')}", daemon=True)
    thread.start()
    result = await done
    thread.join()   # it has only its return left: an idle OpenMP pool of its would slow the engine
    return result


async def drain(running: RunningServer, servicer: InferenceServicer, grace_s: float,
                hurry: asyncio.Event | None = None) -> None:
    """NOT_SERVING first, then no new requests; in-flight streams get up to `grace_s` to finish
    (none once `hurry` is set: Ctrl-C twice), and what is left ends with UNAVAILABLE (the
    manager is still there for their releases)."""
    engine = servicer.engine
    await servicer.health.drain()
    servicer.drain()
    async with goaway_drain(running):
        if servicer.http_front is not None:
            servicer.http_front.begin_stop(grace_s)
        await drain_wait(engine.num_live, grace_s, hurry)
        if engine.num_live():
            hurried = hurry is not None and hurry.is_set()
            log.warning("%d requests still running %s end with UNAVAILABLE", engine.num_live(),
                        "when told to stop now" if hurried else f"after the {grace_s:.1f} s grace period")
            engine.end_all(Unavailable("the server was stopped before the request finished" if hurried else
                                       f"the server shut down before the request finished (it was given "
                                       f"{grace_s:g} s to finish)"))
            await drain_wait(engine.num_live, 2.0)
        # The engine is done with them; each call still has to take its last event off its queue
        # and return (a busy loop can take a while): only then does the server's stop leave it be.
        await drain_wait(lambda: bool(servicer.open_streams), 5.0, hurry)
        if servicer.cache_events is not None:   # a gateway's event stream ends UNAVAILABLE, not cancelled
            await servicer.cache_events.close()
        if servicer.lane is not None:
            await servicer.lane.close()
        await stop_server(running.server, LAST_MESSAGES_S, hurry)
        if servicer.http_front is not None:   # inside the frame: the probe port answers until it has stopped
            await servicer.http_front.stop()


async def serve(config: ModelServiceConfig) -> None:
    running, servicer = await create_server(config)
    log.info("model service on %s%s", running.address, " (TLS)" if config.tls_cert else "")
    if config.ready_file:
        Path(config.ready_file).touch()
    if servicer.keys is not None:
        servicer.keys.watch()
    try:
        hurry = await wait_for_signal(running.server, config.grace_s)
        await drain(running, servicer, config.grace_s, hurry)   # which also ends the relayed event streams and HTTP
    finally:
        servicer.engine.stop()
        servicer.close()
        servicer.stack.kv.close()

