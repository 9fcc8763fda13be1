"""Starts the manager's gRPC server: create_server(...) for tests, serve(...) for the CLI."""

from __future__ import annotations

import asyncio
import gc
import logging

from kvserve.kvcache_service.core.config import ManagerConfig
from kvserve.kvcache_service.core.manager import KVCacheManager
from kvserve.kvcache_service.config import KVCacheServerConfig
from kvserve.kvcache_service.metrics import ManagerMetrics
from kvserve.kvcache_service.servicer import SERVICE_NAME, KVCacheServicer
from kvserve.services.plumbing.api_keys import read_token
from kvserve.services.plumbing.auth import LocalOrAdmin
from kvserve.services.plumbing.metrics_server import serve_metrics
from kvserve.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from kvserve.services.plumbing.grpc_server import RunningServer, ServiceSpec, create_server as _create, serve_until_signal

log = logging.getLogger(__name__)


# What any caller may use. Every other RPC changes state or shows what the cache holds (page
# hashes, a prefix's presence, a sequence's extra_key: enough to test a guess at what another
# tenant sent) and is kept to the pod (auth.py).
OPEN = {"GetStats"}


async def create_server(address: str | list[str], config: ManagerConfig | None = None,
                        server: KVCacheServerConfig | None = None) -> tuple[RunningServer, KVCacheManager]:
    """A started server on `address` (or several; port 0 picks a free port) and the manager behind
    it; `server` adds TLS and the admin token."""
    running, servicer, _ = await _create_with_servicer(address, config, server or KVCacheServerConfig())
    return running, servicer.m


async def _create_with_servicer(address: str | list[str], config: ManagerConfig | None, server: KVCacheServerConfig
                                ) -> tuple[RunningServer, KVCacheServicer, ManagerMetrics]:
    manager = KVCacheManager(config)
    metrics = ManagerMetrics(manager, asyncio.get_running_loop())
    servicer = KVCacheServicer(manager, metrics.step_seconds, metrics.step_streams)
    spec = ServiceSpec(pb_grpc.add_KVCacheManagerServicer_to_server, servicer, SERVICE_NAME)
    guard = LocalOrAdmin(SERVICE_NAME, OPEN, read_token(server.admin_token_file))
    running = await _create(address, [spec], tls=server.server_tls(), interceptors=[guard],
                            health_listen=server.health_listen)
    return running, servicer, metrics


async def serve(config: ManagerConfig, server: KVCacheServerConfig) -> None:
    running, servicer, metrics = await _create_with_servicer(list(server.listen), config, server)
    try:
        endpoint = serve_metrics(server.metrics_listen, metrics.registry) if server.metrics_listen else None
    except BaseException:   # the server started: stopped here, not left to a closed loop's finalizer
        await running.server.stop(None)
        raise
    grace_s = server.grace_s
    # A Step allocates thousands of short-lived objects, which plain reference counting
    # frees; with the default gen-0 threshold (700) the cycle collector still runs several
    # times per Step (its cost: docs/benchmarks.md). Objects made at start-up are frozen out of it.
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    log.info("kv-cache manager: %d pages of %d tokens, %d seq ids, %d CPU pages, on %s",
             config.num_pages, config.page_size, config.max_seqs, config.cpu_pages, ", ".join(running.addresses))
    try:
        await serve_until_signal(running.server, running.health, grace_s, on_stop=servicer.close)
    finally:
        if endpoint is not None:
            endpoint.close()
