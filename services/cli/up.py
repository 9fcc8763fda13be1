"""`kvserve up`: the KV-cache manager and the model service as two processes, kept running;
with --workers N, a gateway on --listen in front of N such pairs.

The model service starts first: it loads the model and sizes its page pool
(on CUDA that takes a profile run), writes the size to a file, and waits for
the manager. Then the manager starts with exactly that size, so the two agree
by construction.

A child that exits is started again (supervisor.py), with a backoff, up to
--max-restarts times a minute: a restarted manager is empty, and the model
service re-admits what it held (its requests pause, then go on); a restarted
model service keeps the first pool size, so the running manager still fits it,
and registers a new epoch, which resets the manager. Ctrl-C or SIGTERM stops
everything: the gateway first, then each model service, which drains its
requests while its manager still serves them, then the managers.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvserve.kvcache_service.config import DEFAULT_LISTEN as KV_LISTEN
from kvserve.kvcache_service.config import KVCacheServerConfig
from kvserve.model_service.config import UINT32_MAX, ModelServiceConfig
from kvserve.services.cli.stack_metrics import StackMetrics
from kvserve.services.cli.supervisor import Child, RestartLimit, Supervisor
from kvserve.services.plumbing.address import free_local_port, is_private, parse_flag
from kvserve.services.plumbing.api_keys import read_token
from kvserve.services.plumbing.metrics_server import serve_metrics
from kvserve.services.plumbing.temp_dir import require_temp_dir
from kvserve.services.plumbing.config_flags import BadFlags, add_arguments, from_args, option, to_argv

log = logging.getLogger("kvserve.up")


# What up wires itself: the link to the manager is a private Unix socket (no TLS or token on it),
# and the pool's size (and a restarted model service's readiness) go through files of up's own.
WIRED_BY_UP = ("kvcache", "sizing_file", "ready_file", "kvcache_tls_ca", "kvcache_tls_cert", "kvcache_tls_key",
               "kvcache_tls_server_name", "kvcache_token_file")


@dataclass(frozen=True)
class UpConfig:
    """What `kvserve up` decides itself; every other flag is the model service's."""
    kvcache_listen: str = option(KV_LISTEN, "the manager's address, host:port or unix:///path")
    max_seqs: int | None = option(None, "the manager's seq-id pool (default: twice --max-num-seqs, at least 256)")
    startup_timeout_s: float = option(600.0, "seconds to wait for the model to load and size its pool",
                                      flag="--startup-timeout")
    max_restarts: int = option(5, "times one child may exit within a minute and be started again; one "
                                  "more stops the stack")
    admin_token_file: str = option("", "file holding a token that lets a caller beyond this machine use the "
                                       "manager's RPCs on a TCP --kvcache-listen (`authorization: Bearer TOKEN`); "
                                       "without it only loopback may, and others get GetStats", metavar="FILE")
    workers: int = option(0, "run a gateway on --listen in front of this many workers, each a model service "
                             "with its own manager on private sockets (0: one model service on --listen); the "
                             "gateway's queue holds at most --max-waiting requests")

    def __post_init__(self) -> None:
        parse_flag("--kvcache-listen", self.kvcache_listen)
        if self.max_seqs is not None and not 0 < self.max_seqs <= UINT32_MAX:
            raise ValueError(f"--max-seqs must be a positive integer of at most {UINT32_MAX:,} (the protocol's ids "
                             f"are 32-bit), got {self.max_seqs}")
        if not 0 < self.startup_timeout_s < math.inf:
            raise ValueError(f"--startup-timeout must be positive, got {self.startup_timeout_s}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must not be negative, got {self.max_restarts}")
        if self.workers < 0:
            raise ValueError(f"--workers must not be negative, got {self.workers}")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="run the manager and the model service together",
                              description=" ".join(__doc__.split("\n\n", 1)[0].split()).split(": ", 1)[1])
    add_arguments(p, UpConfig)
    add_arguments(p, ModelServiceConfig, exclude=WIRED_BY_UP)
    p.set_defaults(func=run)


@dataclass
class Pair:
    """One worker: a model service and its manager, linked by a private Unix socket."""
    model: Child
    manager: Child
    config: ModelServiceConfig
    sizing: Path
    kv_listen: tuple[str, ...]
    manager_metrics: str = ""   # the manager's private metrics address, when the stack serves metrics
    admin_token_file: str = ""  # lets a caller beyond this machine use the manager's --kvcache-listen
    name: str = "worker"        # worker, or worker-N: what its children's log lines carry

    @classmethod
    def make(cls, name: str, cli: list[str], config: ModelServiceConfig, tmp: Path, kv_listen: str | None,
             metrics: StackMetrics | None, admin_token_file: str = "") -> Pair:
        sizing = tmp / f"{name}-sizing.json"
        labels = {"worker": name} if name != "worker" else {}
        manager_metrics = ""
        if metrics is not None:   # each process serves its own series privately; `up` serves them together
            config, manager_metrics = replace(config, metrics_listen=free_local_port()), free_local_port()
            metrics.add(config.metrics_listen, source=name, **labels)
            metrics.add(manager_metrics, source=f"{name}/kvcache", **labels)
        # The engine reaches the manager over a private Unix socket; a --kvcache-listen TCP
        # address stays open beside it for everyone else (grpcurl).
        link = kv_listen if kv_listen and kv_listen.startswith("unix:") else f"unix://{tmp}/{name}-kv.sock"
        ready = tmp / f"{name}-ready"
        config = replace(config, kvcache=link, sizing_file=str(sizing), ready_file=str(ready))
        listen = tuple(dict.fromkeys((kv_listen, link))) if kv_listen else (link,)
        suffix = f" of {name}" if name != "worker" else ""
        return cls(Child(f"the model service{suffix}", [*cli, "--log-source", name, "model", *to_argv(config)],
                         ready_path=ready),
                   Child(f"the KV-cache manager{suffix}", []), config, sizing, listen, manager_metrics,
                   admin_token_file, name)

    def start_manager(self, cli: list[str], size: dict, max_seqs: int | None) -> None:
        # TLS for a TCP --kvcache-listen; the model service's link is a Unix socket
        server = KVCacheServerConfig(listen=self.kv_listen, metrics_listen=self.manager_metrics,
                                     tls_cert=self.config.tls_cert, tls_key=self.config.tls_key,
                                     tls_client_ca=self.config.tls_client_ca, admin_token_file=self.admin_token_file)
        sized = self.config.manager_config(size["num_pages"], size["page_size"], max_seqs)
        self.manager.argv = [*cli, "--log-source", f"{self.name}/kvcache", "kvcache", *to_argv(server),
                             *to_argv(sized)]
        self.manager.start()
        # A restarted model service takes the pool size the manager was started with.
        self.model.argv = [*cli, "--log-source", self.name, "model",
                           *to_argv(replace(self.config, num_pages=size["num_pages"], kv_cache_memory=None,
                                            page_size=size["page_size"]))]


def run(args: argparse.Namespace) -> int:
    up = from_args(UpConfig, args, "kvserve up")
    model_config = from_args(ModelServiceConfig, args, "kvserve up")   # refused here, before anything starts
    check_together(up, model_config)
    try:
        model_config.check_files()
        if not up.workers:   # (with workers it is not used: check_together says so)
            read_token(up.admin_token_file)   # a manager that cannot read it would only exit, again and again
    except ValueError as exc:
        raise SystemExit(f"kvserve up: {exc}") from None
    require_temp_dir("kvserve up")   # the children's private sockets, and torch's caches
    cli = [sys.executable, "-m", "kvserve.services.cli.main", "--log-level", args.log_level,
           "--log-format", args.log_format]
    stop = {"signal": None, "hurry": False}
    started: list[Child] = []   # every child, once made: a second Ctrl-C reaches those draining

    def on_signal(signum, _frame):
        if stop["signal"] is None:
            stop["signal"] = signum
        elif signum == signal.SIGINT and not stop["hurry"]:   # Ctrl-C again: no more waiting for drains
            log.warning("SIGINT again: stopping every server now, without waiting for its requests")
            stop["hurry"] = True
            for child in started:
                child.hurry()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    reloads: list[Child] = []   # the child that checks API keys: SIGHUP goes on to it

    def on_sighup(_signum, _frame):
        if not reloads:   # passed on, it would kill a child that has nothing to re-read
            log.info("SIGHUP ignored: there are no API keys to re-read (--api-keys)")
        for child in reloads:
            child.signal(signal.SIGHUP)

    signal.signal(signal.SIGHUP, on_sighup)
    metrics = StackMetrics() if model_config.metrics_listen else None
    endpoint = None
    with tempfile.TemporaryDirectory(prefix="kvserve-up-") as tmp:
        if up.workers:
            # The gateway is the front: it serves TLS and checks keys; the workers, on private
            # sockets, take each request's tenant from it.
            worker_config = replace(model_config, tls_cert="", tls_key="", tls_client_ca="", api_keys="", http_listen="",
                                    http_allowed_origins="",
                                    health_listen="",
                                    trust_tenant_metadata=bool(model_config.api_keys),
                                    cpu_threads=worker_threads(model_config.cpu_threads, up.workers))
            # Each worker's Generate reaches the gateway over its lane, a hop cheaper than gRPC.
            pairs = [Pair.make(f"worker-{i}", cli, replace(worker_config, listen=f"unix://{tmp}/worker-{i}.sock",
                                                          lane_listen=f"unix://{tmp}/worker-{i}.lane"),
                               Path(tmp), None, metrics) for i in range(up.workers)]
            gateway_metrics = []
            if metrics is not None:
                port = free_local_port()
                gateway_metrics = [f"--metrics-listen={port}"]
                metrics.add(port, workers={p.config.listen: f"worker-{i}" for i, p in enumerate(pairs)},
                            source="gateway")
            gateway = Child("the gateway", [*cli, "--log-source", "gateway",
                                            *gateway_argv(model_config, [p.config.listen for p in pairs],
                                                          gateway_metrics)])
        else:
            pairs = [Pair.make("worker", cli, model_config, Path(tmp), up.kvcache_listen, metrics, up.admin_token_file)]
            gateway = None
        if metrics is not None:
            for p in pairs:
                metrics.count_restarts(p.name, p.model)
                metrics.count_restarts(f"{p.name}/kvcache", p.manager)
            if gateway is not None:
                metrics.count_restarts("gateway", gateway)
            registry = CollectorRegistry()
            registry.register(metrics)
            try:
                endpoint = serve_metrics(model_config.metrics_listen, registry)
            except ValueError as exc:
                log.error("%s", exc)
                return 2
        if model_config.api_keys:
            checker = gateway if gateway is not None else pairs[0].model
            checker.hold_sighup = True   # a SIGHUP sent while it starts waits for its handler
            reloads.append(checker)
        supervisor = Supervisor(up.max_restarts, stopping=lambda: stop["signal"] is not None)
        children = [c for p in pairs for c in (p.manager, p.model)] + ([gateway] if gateway else [])
        started.extend(children)
        try:
            for pair in pairs:
                pair.model.start()
            if not _start_managers(pairs, cli, up, stop, supervisor):
                return 1 if stop["signal"] is None else 0
            if gateway is not None:
                gateway.start()
            while stop["signal"] is None:
                time.sleep(0.1)
                for child in children:
                    child.look_for_ready()
                    if child.exited():
                        supervisor.restart(child)
            return 0
        except RestartLimit as exc:
            log.error("%s", exc)
            return exc.exit_code
        finally:
            if stop["signal"] is not None:
                log.info("%s: stopping the stack", signal.Signals(stop["signal"]).name)
            def halt(group: list[Child], seconds: float) -> None:
                """SIGTERM to each at once (a drain), then each waited for; after a second Ctrl-C,
                SIGINT once its SIGTERM is handled (its "stop now"), and a second each."""
                for child in group:
                    child.terminate()
                if stop["hurry"]:
                    time.sleep(0.2)   # a SIGINT pending beside the SIGTERM could be handled first
                    for child in group:
                        child.hurry()
                for child in group:
                    child.stop(1.0 if stop["hurry"] else seconds)

            if gateway is not None:
                halt([gateway], model_config.grace_s + 10)
            halt([p.model for p in pairs], model_config.grace_s + 10)   # each drains while its manager serves it
            halt([p.manager for p in pairs], 10)
            if endpoint is not None:
                endpoint.close()


def worker_threads(cpu_threads: int, workers: int, cores: int | None = None) -> int:
    """Each worker's --cpu-threads on a machine the workers share: as given, or (0) this machine's
    cores shared out, one at least. Each taking every core (a lone worker's default) runs N
    thread pools on the same cores, which multi-threaded matmuls survive badly
    (docs/benchmarks.md)."""
    if cpu_threads:
        return cpu_threads
    affinity = getattr(os, "sched_getaffinity", None)   # (Linux's: the cores this process may use)
    cores = cores or (len(affinity(0)) if affinity is not None else os.cpu_count() or 1)
    threads = max(1, cores // workers)
    log.info("on CPU, each of the %d workers computes on %d of this machine's %d cores (--cpu-threads sets it)",
             workers, threads, cores)
    return threads


def gateway_argv(model_config: ModelServiceConfig, workers: list[str], extra: list[str]) -> list[str]:
    """`kvserve gateway ...` in front of `workers`. Each flag `--flag=value`, as to_argv writes the
    others': a value may begin with "-" (a salt), which argparse takes for a flag otherwise."""
    return ["gateway", f"--listen={model_config.listen}", f"--model={model_config.model}",
            f"--cache-salt={model_config.cache_salt}", *extra, *front_flags(model_config),
            *[f"--worker={address}" for address in workers]]


def front_flags(model_config: ModelServiceConfig) -> list[str]:
    """What the gateway in front of the workers takes of the front's flags: it serves TLS, checks
    keys, serves HTTP and health, bounds requests, keeps at most --max-waiting requests in its
    queue (where they wait with workers in front) and drains the streams on SIGTERM."""
    flags = [f"--{name.replace('_', '-')}={getattr(model_config, name)}"
             for name in ("tls_cert", "tls_key", "tls_client_ca", "api_keys", "http_listen", "http_allowed_origins",
                          "health_listen",
                          "max_request_bytes", "max_prompt_chars", "max_chat_messages", "tokenizer_threads", "max_n")
             if getattr(model_config, name)]
    return flags + [f"--max-queued={model_config.max_waiting}", f"--grace-period={model_config.grace_s}"]


def check_together(up: UpConfig, model_config: ModelServiceConfig) -> None:
    """Flags each valid alone that contradict each other: refused (BadFlags) or, where one is
    merely unused, said."""
    if up.workers and up.kvcache_listen != KV_LISTEN:
        log.warning("--kvcache-listen %s is not used: with --workers each worker's manager listens on a private "
                    "socket (the gateway reads their events through the workers)", up.kvcache_listen)
    if up.workers and model_config.lane_listen:
        log.warning("--lane-listen %s is not used: with --workers each worker's lane listens on a private socket",
                    model_config.lane_listen)
    if up.workers and up.admin_token_file:
        log.warning("--admin-token-file %s is not used: with --workers each worker's manager listens on a private "
                    "socket only", up.admin_token_file)
    if (not up.workers and up.admin_token_file and not is_private(up.kvcache_listen)
            and not model_config.tls_cert):   # (as the manager refuses it)
        raise BadFlags(f"kvserve up: --admin-token-file with --kvcache-listen {up.kvcache_listen}: callers would "
                       "send the admin token in plaintext; serve TLS (--tls-cert, --tls-key) or keep the manager "
                       "on loopback")
    if not up.workers and up.kvcache_listen == model_config.listen:
        raise BadFlags(f"kvserve up: --listen and --kvcache-listen are both {up.kvcache_listen}; the model "
                         "service and its manager need an address each")


def _start_managers(pairs: list[Pair], cli: list[str], up: UpConfig, stop: dict, supervisor: Supervisor) -> bool:
    """Each pair's manager, started as soon as its model service has sized its page pool (the
    pool size it writes once loaded), in whatever order they load: a worker waiting on another's
    load would wait past its --kvcache-timeout. A model service killed while loading (the OOM
    killer, kill -9) is started again within --max-restarts (RestartLimit); one that exits by
    itself refused to start, its error above, and would again: False."""
    deadline = time.monotonic() + up.startup_timeout_s
    waiting = list(pairs)
    while waiting and time.monotonic() < deadline and stop["signal"] is None:
        for pair in list(waiting):
            if pair.sizing.exists():
                pair.start_manager(cli, json.loads(pair.sizing.read_text()), up.max_seqs)
                waiting.remove(pair)
            elif pair.model.exited():
                if pair.model.proc.returncode >= 0:
                    log.error("the model service %s while starting", pair.model.exit_reason())
                    return False
                supervisor.restart(pair.model)
        if waiting:
            time.sleep(0.1)
    if waiting and stop["signal"] is None:
        log.error("the model service did not size its page pool within %g s", up.startup_timeout_s)
    return not waiting
