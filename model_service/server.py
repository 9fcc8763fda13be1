"""Starts the model service: build the stack, start the engine, serve Inference."""

from __future__ import annotations

import asyncio
import logging

from kvserve.model_service.assembly import build_on_a_thread_that_ends
from kvserve.model_service.event_relay import EventRelay
from kvserve.model_service.config import ModelServiceConfig
from kvserve.model_service.servicer import SERVICE_NAME, InferenceServicer
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.services.plumbing.grpc_server import RunningServer, ServiceSpec, create_server as _create, serve_until_signal

log = logging.getLogger(__name__)


async def create_server(config: ModelServiceConfig) -> tuple[RunningServer, InferenceServicer]:
    """A started server (the engine running) on config.listen; port 0 picks a free port."""
    # The engine hands each step's events to this loop at once, through the relay.
    relay = EventRelay(asyncio.get_running_loop())
    # The executor's thread only waits; torch runs on one that ends.
    stack = await asyncio.to_thread(build_on_a_thread_that_ends, config, relay.flush)
    try:
        stack.engine.start()
        servicer = InferenceServicer(stack, relay)
        spec = ServiceSpec(pb_grpc.add_InferenceServicer_to_server, servicer, SERVICE_NAME)
        return await _create(config.listen, [spec]), servicer
    except Exception:
        stack.engine.stop()
        stack.kv.close()
        raise


async def serve(config: ModelServiceConfig) -> None:
    running, servicer = await create_server(config)
    log.info("model service on %s", running.address)
    try:
        await serve_until_signal(running.server, running.health, config.grace_s, on_stop=servicer.drain)
    finally:
        servicer.engine.stop()
        servicer.stack.kv.close()
