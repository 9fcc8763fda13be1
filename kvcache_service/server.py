"""Starts the manager's gRPC server: create_server(...) for tests, serve(...) for the CLI."""

from __future__ import annotations

import gc
import logging

from kvserve.kvcache_service.core.config import ManagerConfig
from kvserve.kvcache_service.core.manager import KVCacheManager
from kvserve.kvcache_service.servicer import SERVICE_NAME, KVCacheServicer
from kvserve.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from kvserve.services.plumbing.grpc_server import RunningServer, ServiceSpec, create_server as _create, serve_until_signal

log = logging.getLogger(__name__)


async def create_server(address: str | list[str], config: ManagerConfig | None = None
                        ) -> tuple[RunningServer, KVCacheManager]:
    """A started server on `address` (or several; port 0 picks a free port) and the manager behind it."""
    running, servicer = await _create_with_servicer(address, config)
    return running, servicer.m


async def _create_with_servicer(address: str | list[str], config: ManagerConfig | None
                                ) -> tuple[RunningServer, KVCacheServicer]:
    servicer = KVCacheServicer(KVCacheManager(config))
    spec = ServiceSpec(pb_grpc.add_KVCacheManagerServicer_to_server, servicer, SERVICE_NAME)
    return await _create(address, [spec]), servicer


async def serve(address: str | list[str], config: ManagerConfig, grace_s: float = 5.0) -> None:
    running, servicer = await _create_with_servicer(address, config)
    # A Step allocates thousands of short-lived objects, which plain reference counting
    # frees; with the default gen-0 threshold (700) the cycle collector still runs several
    # times per Step (its cost: docs/benchmarks.md). Objects made at start-up are frozen out of it.
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    log.info("kv-cache manager: %d pages of %d tokens, %d seq ids, %d CPU pages, on %s",
             config.num_pages, config.page_size, config.max_seqs, config.cpu_pages, ", ".join(running.addresses))
    await serve_until_signal(running.server, running.health, grace_s, on_stop=servicer.close)
