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
from pathlib import Path

from kvserve.kvcache_service.cli import DEFAULT_LISTEN as KV_LISTEN
from kvserve.model_service.cli import add_model_arguments
from kvserve.model_service.config import DEFAULT_LISTEN

_MODEL_FLAGS = ("model", "dtype", "device", "attention_backend", "cpu_gemm", "page_size", "num_pages", "kv_cache_memory",
                "gpu_memory_utilization", "swap_pages", "preemption_mode", "max_num_seqs",
                "max_num_batched_tokens", "max_waiting", "stream_interval", "max_model_len", "cache_salt",
                "grace_period")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="run the manager and the model service together",
                              description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("--listen", default=DEFAULT_LISTEN, help=f"the model service's address (default {DEFAULT_LISTEN})")
    p.add_argument("--kvcache-listen", default=KV_LISTEN,
                   help=f"the manager's address, host:port or unix:///path (default {KV_LISTEN})")
    p.add_argument("--max-seqs", type=int, default=None,
                   help="the manager's seq-id pool (default: twice --max-num-seqs, at least 256)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds to wait for the model to load and size its pool (default 600)")
    add_model_arguments(p)
    p.set_defaults(func=run)


def _flag_args(args: argparse.Namespace) -> list[str]:
    out = [] if args.prefix_caching else ["--no-prefix-caching"]
    for name in _MODEL_FLAGS:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def run(args: argparse.Namespace) -> int:
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
        link = args.kvcache_listen if args.kvcache_listen.startswith("unix:") else f"unix://{tmp}/kv.sock"
        # Own sessions: a terminal's Ctrl-C reaches only us, and we stop the children in order.
        model = subprocess.Popen(cli + ["model", "--listen", args.listen, "--kvcache", link,
                                        "--sizing-file", str(sizing)] + _flag_args(args), start_new_session=True)
        procs = [model]
        try:
            size = _wait_for_sizing(sizing, model, args.startup_timeout, stop)
            if size is None:
                return 1 if stop["signal"] is None else 0
            max_seqs = args.max_seqs or max(256, 2 * args.max_num_seqs)
            listens = ["--listen", args.kvcache_listen] + (["--listen", link] if link != args.kvcache_listen else [])
            kv = subprocess.Popen(cli + ["kvcache", *listens,
                                         "--num-pages", str(size["num_pages"]), "--page-size", str(size["page_size"]),
                                         "--max-seqs", str(max_seqs), "--cpu-pages", str(args.swap_pages)],
                                  start_new_session=True)
            procs.append(kv)
            while stop["signal"] is None and all(p.poll() is None for p in procs):
                time.sleep(0.2)
            failed = [p for p in procs if p.poll() not in (None, 0)]
            return 1 if failed and stop["signal"] is None else 0
        finally:
            _stop_all(procs, args.grace_period + 10)


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
