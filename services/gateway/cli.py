"""`kvserve gateway`: one Inference address in front of the workers."""

from __future__ import annotations

import argparse
import asyncio

from kvserve.services.gateway.config import GatewayConfig
from kvserve.services.plumbing.config_flags import BadFlags, add_arguments, from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("gateway", help="route requests to a fleet of model services by what their "
                                              "caches hold",
                              description="Serve kvserve.inference.v1.Inference in front of model services "
                                          "(workers), each request going to the worker that holds its prefix.")
    add_arguments(p, GatewayConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.services.plumbing.api_keys import keep_sighup_until_watched
    from kvserve.services.plumbing.first_process import exit_on_sigterm_while_starting

    exit_on_sigterm_while_starting()   # a container's PID 1: the tokenizer's load takes seconds
    config = from_args(GatewayConfig, args, "kvserve gateway")
    if not config.worker and not config.workers_dns:
        raise BadFlags("kvserve gateway: give --worker ADDR (repeat it) or --workers-dns NAME:PORT")
    if config.api_keys:   # before the imports and the tokenizer's load
        keep_sighup_until_watched()
    from kvserve.services.gateway.server import serve

    try:
        asyncio.run(serve(config))
    except ValueError as exc:   # an address it cannot serve on, a certificate or key file it cannot read
        raise SystemExit(f"kvserve gateway: {exc}") from None
    return 0
