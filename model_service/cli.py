"""`kvserve model`: the model service alone, beside a manager that runs elsewhere (a sidecar).
Its flags are ModelServiceConfig's fields (config.py)."""

from __future__ import annotations

import argparse

from kvserve.model_service.config import ModelServiceConfig
from kvserve.services.plumbing.config_flags import add_arguments, from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("model", help="run the model service alone",
                              description="Run the model service; the KV-cache manager runs elsewhere.")
    add_arguments(p, ModelServiceConfig)
    p.set_defaults(func=run_model)


def run_model(args: argparse.Namespace) -> int:
    import asyncio

    from kvserve.services.plumbing.api_keys import keep_sighup_until_watched
    from kvserve.services.plumbing.first_process import exit_on_sigterm_while_starting
    from kvserve.services.plumbing.temp_dir import require_temp_dir

    exit_on_sigterm_while_starting()   # a container's PID 1: the model may load for minutes
    config = from_args(ModelServiceConfig, args, "kvserve model")
    require_temp_dir("kvserve model")   # torch's caches: without one, the model "cannot load"
    if config.api_keys:   # before the imports and the model's load, which take seconds
        keep_sighup_until_watched()
    from kvserve.kvcache_service.contract.errors import KVCacheError
    from kvserve.model_service.server import serve

    try:
        asyncio.run(serve(config))
    except (ValueError, ConnectionError, KVCacheError) as exc:  # bad model/config, manager refused or unreachable
        raise SystemExit(f"kvserve model: {exc}") from None
    return 0
