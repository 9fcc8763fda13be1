"""Starts the gateway: the fleet (workers from --worker and --workers-dns), the Inference
service in front of it, and health that says SERVING while at least one worker does."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from grpc_health.v1 import health_pb2

from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.model_service.prompt_tokens import load_tokenizer, resolve_model_path
from kvserve.services.gateway.config import GatewayConfig
from kvserve.services.gateway.discovery import follow_dns
from kvserve.services.gateway.fleet import Fleet
from kvserve.services.gateway.fleet_model import FleetModel
from kvserve.services.gateway.inputs import Inputs
from kvserve.services.gateway.metrics import GatewayMetrics
from kvserve.services.gateway.servicer import SERVICE_NAME, GatewayServicer
from kvserve.services.gateway.waiting import WaitQueue
from kvserve.services.http.server import HttpFront
from kvserve.services.http.translate import Limits
from kvserve.services.plumbing import server_flags
from kvserve.services.plumbing.api_keys import ApiKeys
from kvserve.services.plumbing.auth import RequireApiKey
from kvserve.services.plumbing.metrics_server import MetricsEndpoint, serve_metrics
from kvserve.services.plumbing.grpc_server import (LAST_MESSAGES_S, RunningServer, ServiceSpec, create_server as _create,
                                                   drain_wait, goaway_drain, stop_server, wait_for_signal)

log = logging.getLogger(__name__)

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Gateway:
    running: RunningServer | None   # None only while create_gateway builds it
    servicer: GatewayServicer
    fleet: Fleet
    tasks: list[asyncio.Task]
    metrics_endpoint: MetricsEndpoint | None = None
    http_front: HttpFront | None = None

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.fleet.close()
        self.servicer.inputs.close()
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()
        if self.http_front is not None:
            await self.http_front.stop()


async def create_gateway(config: GatewayConfig) -> Gateway:
    config.check_files()
    path = await asyncio.to_thread(resolve_model_path, config.model)
    tokenizer = await asyncio.to_thread(load_tokenizer, path)
    model = await asyncio.to_thread(FleetModel.of, path, tokenizer)
    metrics = GatewayMetrics()
    queue = WaitQueue(config.max_queued, on_leave=metrics.queue_wait.observe)
    keys = ApiKeys(config.api_keys) if config.api_keys else None
    server_flags.warn_keys_in_plaintext(config.api_keys, config.tls_cert, config.listen, config.http_listen)
    fleet = Fleet(config.cache_salt, config.overlap_weight, config.worker_queue_depth, config.poll_interval_s, queue,
                  config.routing, config.balance_slack, config.worker_tls(), tenants=keys is not None, model=model,
                  lanes=config.lane == "auto")
    inputs = Inputs(tokenizer, config.tokenizer_threads, config.max_prompt_chars, config.max_chat_messages)
    servicer = GatewayServicer(fleet, inputs, config.migration_limit,
                               config.no_worker_timeout_s, keys, config.max_n)
    gateway = Gateway(None, servicer, fleet, [])
    try:   # what started is stopped again if a later part cannot start
        for address in config.worker:
            fleet.add(address)
        metrics.follow(fleet, asyncio.get_running_loop())
        if config.metrics_listen:
            gateway.metrics_endpoint = serve_metrics(config.metrics_listen, metrics.registry)
        gateway.running = await _create(
            config.listen,
            [ServiceSpec(pb_grpc.add_InferenceServicer_to_server, servicer, SERVICE_NAME)],
            options={"grpc.max_receive_message_length": config.max_request_bytes}, tls=config.server_tls(),
            interceptors=[RequireApiKey(keys, {SERVICE_NAME})] if keys else [], health_listen=config.health_listen)
        gateway.tasks.append(asyncio.create_task(_report_health(gateway.running, fleet, servicer),
                                                 name="gateway health"))
        if config.workers_dns:
            gateway.tasks.append(asyncio.create_task(follow_dns(fleet, config.workers_dns, config.dns_interval_s),
                                                     name="gateway dns"))
        if config.http_listen:
            gateway.http_front = await HttpFront.start(config.http_listen, gateway.running.local_channel(),
                                                       config.server_tls(), config.max_request_bytes, keys,
                                                       server_flags.allowed_origins(config.http_allowed_origins),
                                                       Limits.of(config), metrics.http_answered)
        return gateway
    except BaseException:
        if gateway.running is not None:
            await gateway.running.server.stop(None)
        await gateway.close()
        raise


async def _report_health(running: RunningServer, fleet: Fleet, servicer: GatewayServicer) -> None:
    """The default service (and Inference's name): SERVING while a worker is; `liveness`: SERVING
    while this loop runs (no serving worker is not cured by restarting the gateway)."""
    await running.health.set("liveness", SERVING)
    told = None
    while not servicer.draining:
        status = SERVING if fleet.serving() else NOT_SERVING
        if status != told:
            for name in ("", SERVICE_NAME):
                await running.health.set(name, status)
            log.info("gateway health: %s (%d of %d workers serving)", "SERVING" if status == SERVING else
                     "NOT_SERVING", len(fleet.serving()), len(fleet.workers))
            told = status
        await asyncio.sleep(0.2)


async def serve(config: GatewayConfig) -> None:
    gateway = await create_gateway(config)
    if gateway.servicer.keys is not None:
        gateway.servicer.keys.watch()
    log.info("gateway on %s, %d workers given%s", gateway.running.address, len(config.worker),
             f", following {config.workers_dns}" if config.workers_dns else "")
    try:
        hurry = await wait_for_signal(gateway.running.server, config.grace_s)
        await drain(gateway, config.grace_s, hurry)
    finally:
        await gateway.close()


async def drain(gateway: Gateway, grace_s: float, hurry: asyncio.Event | None = None) -> None:
    """NOT_SERVING and no new requests; streams get `grace_s` to finish (none once `hurry` is
    set: Ctrl-C twice), then end UNAVAILABLE (their workers' pages are freed as the upstream
    calls are cancelled)."""
    servicer = gateway.servicer
    servicer.draining = True
    for name in ("", SERVICE_NAME):
        await gateway.running.health.set(name, NOT_SERVING)
    async with goaway_drain(gateway.running):
        if gateway.http_front is not None:
            gateway.http_front.begin_stop(grace_s)
        await drain_wait(lambda: bool(servicer.relays), grace_s, hurry)
        why = ("the gateway was stopped before the request finished" if hurry is not None and hurry.is_set() else
               f"the gateway shut down before the request finished (it was given {grace_s:g} s to finish)")
        for relay in list(servicer.relays.values()):
            relay.end(why)
        await drain_wait(lambda: bool(servicer.relays), 2.0)
        await stop_server(gateway.running.server, LAST_MESSAGES_S, hurry)
        if gateway.http_front is not None:   # inside the frame: the probe port answers until it has stopped
            await gateway.http_front.stop()
