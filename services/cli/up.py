"""`kvserve up`: the KV-cache manager and the model service as two processes, kept running.

The model service starts first: it loads the model and sizes its page pool
(on CUDA that takes a profile run), writes the size to a file, and waits for
the manager. Then the manager starts with exactly that size, so the two agree
by construction.

A child that exits is started again (supervisor.py), with a backoff, up to
--max-restarts times a minute: a restarted manager is empty, and the model
service re-admits what it held (its requests pause, then go on); a restarted
model service keeps the first pool size, so the running manager still fits it,
and registers a new epoch, which resets the manager. Ctrl-C or SIGTERM stops
both: the model service first, which drains its requests while the manager
still serves them, then the manager.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kvserve.kvcache_service.config import DEFAULT_LISTEN as KV_LISTEN
from kvserve.kvcache_service.config import KVCacheServerConfig
from kvserve.model_service.config import ModelServiceConfig
from kvserve.services.cli.supervisor import Child, RestartLimit, Supervisor
from kvserve.services.plumbing.config_flags import add_arguments, from_args, option, to_argv

log = logging.getLogger("kvserve.up")


@dataclass(frozen=True)
class UpConfig:
    """What `kvserve up` decides itself; every other flag is the model service's."""
    kvcache_listen: str = option(KV_LISTEN, "the manager's address, host:port or unix:///path")
    max_seqs: int | None = option(None, "the manager's seq-id pool (default: twice --max-num-seqs, at least 256)")
    startup_timeout_s: float = option(600.0, "seconds to wait for the model to load and size its pool",
                                      flag="--startup-timeout")
    max_restarts: int = option(5, "times one child may exit within a minute and be started again; one "
                                  "more stops the stack")

    def __post_init__(self) -> None:
        if self.max_seqs is not None and self.max_seqs <= 0:
            raise ValueError(f"--max-seqs must be a positive integer, got {self.max_seqs}")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"--startup-timeout must be positive, got {self.startup_timeout_s}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must not be negative, got {self.max_restarts}")


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
        model = Child("the model service", cli + ["model", *to_argv(model_config)])
        manager = Child("the KV-cache manager", [])
        supervisor = Supervisor(up.max_restarts, stopping=lambda: stop["signal"] is not None)
        try:
            model.start()
            size = _wait_for_sizing(sizing, model, up.startup_timeout_s, stop)
            if size is None:
                return 1 if stop["signal"] is None else 0
            server = KVCacheServerConfig(listen=tuple(dict.fromkeys((up.kvcache_listen, link))))
            sized = model_config.manager_config(size["num_pages"], size["page_size"], up.max_seqs)
            manager.argv = cli + ["kvcache", *to_argv(server), *to_argv(sized)]
            manager.start()
            # A restarted model service takes the pool size the manager was started with.
            model.argv = cli + ["model", *to_argv(replace(model_config, num_pages=size["num_pages"],
                                                          page_size=size["page_size"]))]
            while stop["signal"] is None:
                time.sleep(0.1)
                for child in (manager, model):
                    if child.exited():
                        supervisor.restart(child)
            return 0
        except RestartLimit as exc:
            log.error("%s", exc)
            return 1
        finally:
            model.stop(model_config.grace_s + 10)   # it drains while the manager still serves it
            manager.stop(10)


def _wait_for_sizing(path: Path, model: Child, timeout: float, stop: dict) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and stop["signal"] is None:
        if path.exists():
            return json.loads(path.read_text())
        if model.exited():
            log.error("the model service %s while starting", model.exit_reason())
            return None
        time.sleep(0.1)
    if stop["signal"] is None:
        log.error("the model service did not size its page pool within %.0f s", timeout)
    return None
