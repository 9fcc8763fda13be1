"""`kvserve up`: the KV-cache manager and the model service as two processes.

The model service starts first: it loads the model and sizes its page pool
(on CUDA that takes a profile run), writes the size to a file, and waits for
the manager. Then the manager starts with exactly that size, so the two agree
by construction. Ctrl-C or SIGTERM stops both; if either dies, so does the other.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kvserve.kvcache_service.config import DEFAULT_LISTEN as KV_LISTEN
from kvserve.kvcache_service.config import KVCacheServerConfig
from kvserve.model_service.config import ModelServiceConfig
from kvserve.services.plumbing.config_flags import add_arguments, from_args, option, to_argv


@dataclass(frozen=True)
class UpConfig:
    """What `kvserve up` decides itself; every other flag is the model service's."""
    kvcache_listen: str = option(KV_LISTEN, "the manager's address, host:port or unix:///path")
    max_seqs: int | None = option(None, "the manager's seq-id pool (default: twice --max-num-seqs, at least 256)")
    startup_timeout_s: float = option(600.0, "seconds to wait for the model to load and size its pool",
                                      flag="--startup-timeout")

    def __post_init__(self) -> None:
        if self.max_seqs is not None and self.max_seqs <= 0:
            raise ValueError(f"--max-seqs must be a positive integer, got {self.max_seqs}")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"--startup-timeout must be positive, got {self.startup_timeout_s}")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="run the manager and the model service together",
                              description=__doc__.splitlines()[0].split(": ", 1)[1])
    add_arguments(p, UpConfig)
    add_arguments(p, ModelServiceConfig, exclude=("kvcache", "sizing_file"))   # up wires those itself
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    up = from_args(UpConfig, args, "kvserve up")
    model_config = from_args(ModelServiceConfig, args, "kvserve up")   # refused here, before anything starts
    cli = [sys.executable, "-m", "kvserve.services.cli.main", "--log-level", args.log_level]
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with tempfile.TemporaryDirectory(prefix="kvserve-up-") as tmp:
        sizing = Path(tmp) / "sizing.json"
        # Both run on this host: the engine reaches the manager over a private Unix socket;
        # --kvcache-listen stays open for everyone else (grpcurl, a gateway's WatchEvents).
        link = up.kvcache_listen if up.kvcache_listen.startswith("unix:") else f"unix://{tmp}/kv.sock"
        model_config = replace(model_config, kvcache=link, sizing_file=str(sizing))
        # Own sessions: a terminal's Ctrl-C reaches only us, and we stop the children in order.
        model = subprocess.Popen(cli + ["model", *to_argv(model_config)], start_new_session=True)
        procs = [model]
        try:
            size = _wait_for_sizing(sizing, model, up.startup_timeout_s, stop)
            if size is None:
                return 1 if stop["signal"] is None else 0
            manager = model_config.manager_config(size["num_pages"], size["page_size"], up.max_seqs)
            server = KVCacheServerConfig(listen=tuple(dict.fromkeys((up.kvcache_listen, link))))
            kv = subprocess.Popen(cli + ["kvcache", *to_argv(server), *to_argv(manager)], start_new_session=True)
            procs.append(kv)
            while stop["signal"] is None and all(p.poll() is None for p in procs):
                time.sleep(0.2)
            failed = [p for p in procs if p.poll() not in (None, 0)]
            return 1 if failed and stop["signal"] is None else 0
        finally:
            _stop_all(procs, model_config.grace_s + 10)


def _wait_for_sizing(path: Path, model: subprocess.Popen, timeout: float, stop: dict) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and stop["signal"] is None:
        if path.exists():
            return json.loads(path.read_text())
        if model.poll() is not None:
            print(f"kvserve up: the model service exited with code {model.returncode} while starting",
                  file=sys.stderr)
            return None
        time.sleep(0.1)
    if stop["signal"] is None:
        print(f"kvserve up: the model service did not size its page pool within {timeout:.0f} s",
              file=sys.stderr)
    return None


def _stop_all(procs: list[subprocess.Popen], timeout: float) -> None:
    """Model service first (it drains its requests, which still need the manager), then the manager."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
