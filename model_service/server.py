"""Starts the model service: build the stack, start the engine, serve Inference."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from model_service.assembly import ModelStack, build
from model_service.config import ModelServiceConfig
from model_service.servicer import SERVICE_NAME, InferenceServicer
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from services.grpc_server import RunningServer, ServiceSpec, create_server as _create, serve_until_signal

log = logging.getLogger(__name__)


async def create_server(config: ModelServiceConfig, stack: ModelStack | None = None
                        ) -> tuple[RunningServer, InferenceServicer]:
    """A started server (the engine running) on config.listen; port 0 picks a free port."""
    if stack is None:
        # On a thread that ends once built: a thread that ran torch keeps an idle OpenMP
        # pool while it lives, and with more OpenMP threads than cores libgomp stops spinning
        # between parallel regions, so every region of the engine thread's forward waited to
        # wake its workers (bench model, 256 new tokens: 8.3 s instead of 6.9 s).
        with ThreadPoolExecutor(1, thread_name_prefix="kvserve-build") as build_thread:
            stack = await asyncio.get_running_loop().run_in_executor(build_thread, build, config)
    try:
        stack.engine.start()
        servicer = InferenceServicer(stack)
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
