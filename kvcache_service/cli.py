"""`kvserve kvcache`: run the KV-cache manager as a gRPC service."""

from __future__ import annotations

import argparse
import asyncio

from kvserve.kvcache_service.config import KVCacheServerConfig
from kvserve.kvcache_service.core.config import ManagerConfig
from kvserve.services.plumbing.config_flags import add_arguments, from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("kvcache", help="run the KV-cache manager",
                              description="Run the KV-cache manager gRPC service.")
    add_arguments(p, KVCacheServerConfig)
    add_arguments(p, ManagerConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.kvcache_service.server import serve

    server = from_args(KVCacheServerConfig, args, "kvserve kvcache")
    manager = from_args(ManagerConfig, args, "kvserve kvcache")
    try:
        asyncio.run(serve(manager, server))
    except ValueError as exc:   # an address it cannot serve on, a certificate or key file it cannot read
        raise SystemExit(f"kvserve kvcache: {exc}") from None
    return 0
