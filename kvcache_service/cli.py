"""`kvserve kvcache`: run the KV-cache manager as a gRPC service."""

from __future__ import annotations

import argparse
import asyncio

from kvserve.kvcache_service.core.config import ManagerConfig

DEFAULT_LISTEN = "127.0.0.1:50061"


def add_manager_arguments(parser: argparse.ArgumentParser) -> None:
    """The pool sizes; `kvserve up` reuses them."""
    d = ManagerConfig()
    parser.add_argument("--num-pages", type=int, default=d.num_pages,
                        help=f"device KV pages; must match the model service (default {d.num_pages})")
    parser.add_argument("--page-size", type=int, default=d.page_size,
                        help=f"tokens per page; must match the model service (default {d.page_size})")
    parser.add_argument("--max-seqs", type=int, default=d.max_seqs,
                        help=f"live sequences at once: the seq-id pool (default {d.max_seqs})")
    parser.add_argument("--cpu-pages", type=int, default=d.cpu_pages,
                        help=f"CPU swap pages; 0 disables swapping (default {d.cpu_pages})")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("kvcache", help="run the KV-cache manager",
                              description="Run the KV-cache manager gRPC service.")
    p.add_argument("--listen", action="append", default=None, metavar="ADDR",
                   help=f"host:port or unix:///path; repeat to listen on several (default {DEFAULT_LISTEN})")
    add_manager_arguments(p)
    p.add_argument("--grace-period", type=float, default=5.0,
                   help="seconds in-flight calls get on SIGTERM (default 5)")
    p.set_defaults(func=run)


def manager_config(args: argparse.Namespace) -> ManagerConfig:
    try:
        return ManagerConfig(num_pages=args.num_pages, page_size=args.page_size,
                             max_seqs=args.max_seqs, cpu_pages=args.cpu_pages)
    except ValueError as exc:
        raise SystemExit(f"kvserve kvcache: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from kvserve.kvcache_service.server import serve
    asyncio.run(serve(args.listen or [DEFAULT_LISTEN], manager_config(args), grace_s=args.grace_period))
    return 0
