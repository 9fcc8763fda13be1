"""What `kvserve gateway` serves on and how it routes. Every field is a flag."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvserve.kvcache_service.contract.hashing import check_deployment_salt
from kvserve.services.plumbing import server_flags
from kvserve.services.plumbing.address import check_dial, check_tcp_listen, parse_flag
from kvserve.services.plumbing.config_flags import MAX_REQUEST_BYTES, option, parse_bytes
from kvserve.services.plumbing.tls import ClientTLS, ServerTLS

DEFAULT_LISTEN = "127.0.0.1:50050"
ROUTINGS = ("cache", "round-robin", "random")


@dataclass(frozen=True)
class GatewayConfig:
    listen: str = option(DEFAULT_LISTEN, "host:port or unix:///path to serve Inference on")
    worker: tuple[str, ...] = option((), "a model service's address; repeat for each worker", metavar="ADDR")
    workers_dns: str = option("", "NAME:PORT resolved every --dns-interval seconds, one worker per address "
                                  "(a Kubernetes headless Service)", metavar="NAME:PORT")
    dns_interval_s: float = option(5.0, "seconds between resolutions of --workers-dns", flag="--dns-interval")
    model: str = option("tiny", "the workers' checkpoint directory (or built-in model): the gateway tokenizes "
                                "with its tokenizer, as the workers do, and routes nothing to a worker serving "
                                "another model (architecture, vocabulary, shape or tokenizer; kvserve stats says "
                                "why)")
    cache_salt: str = option("", "the workers' --cache-salt: the extra_key the gateway hashes prompts with")
    routing: str = option("cache", "how a worker is chosen: cache (its cached prefix and its load), or, for "
                                   "comparison, round-robin or random among workers with room",
                          choices=ROUTINGS)
    overlap_weight: float = option(1.0, "cost of one prompt token a worker must compute, against one token of "
                                        "its decode load")
    balance_slack: int = option(4, "sequences running and requests waiting a worker may have beyond the least "
                                   "busy one and still be chosen for what its cache holds")
    worker_queue_depth: int = option(2, "requests waiting at one worker beyond its --max-num-seqs sequences "
                                        "before the gateway keeps new ones in its own queue (a request of n "
                                        "counts n sequences)")
    max_queued: int = option(1024, "requests in the gateway's queue before RESOURCE_EXHAUSTED")
    migration_limit: int = option(3, "times one request may move to another worker when its worker fails "
                                     "mid-stream (0: never; it then ends UNAVAILABLE); one that two workers "
                                     "failed before computing its prompt moves no more")
    no_worker_timeout_s: float = option(30.0, "seconds a request may wait while no worker is serving before it "
                                              "ends UNAVAILABLE", flag="--no-worker-timeout")
    poll_interval_s: float = option(0.05, "seconds between looks at each worker's load and health: each worker "
                                          "pushes a report when they changed, at most this often (a worker "
                                          "without WatchServerStats is polled this often); 0.01 to 60",
                                   flag="--poll-interval")
    tokenizer_threads: int = option(2, "threads that tokenize and render chat templates, off the event loop "
                                       "(prompts over 32,768 characters: one more thread of their own)")
    # The workers' limits on each request (kvserve up passes its own): refused here, before any work.
    max_request_bytes: int = option(8 << 20, "largest request message, e.g. 8MiB", parse=parse_bytes)
    max_prompt_chars: int = option(1_000_000, "longest prompt, or chat messages' text together, in characters")
    max_chat_messages: int = option(1024, "most messages in one chat request")
    max_n: int = option(256, "most sequences one request may sample in parallel (its n); a worker refuses "
                             "more than its own --max-n (kvserve up passes it)")
    grace_s: float = option(5.0, "seconds in-flight streams get on SIGTERM", flag="--grace-period")
    lane: str = option("auto", "auto: send each request over its worker's lane where the worker offers one "
                               "(its --lane-listen), a hop cheaper than gRPC; off: gRPC always", choices=("auto", "off"))
    metrics_listen: str = server_flags.metrics_listen()
    http_listen: str = server_flags.http_listen()
    http_allowed_origins: str = server_flags.http_allowed_origins()
    tls_cert: str = server_flags.tls_cert()
    tls_key: str = server_flags.tls_key()
    tls_client_ca: str = server_flags.tls_client_ca()
    health_listen: str = server_flags.health_listen()
    api_keys: str = option("", "file of `KEY TENANT` lines: every Inference call needs `authorization: Bearer "
                               "KEY`; each tenant's prefix cache is its own at every worker; re-read on SIGHUP "
                               "(the workers run with --trust-tenant-metadata)", metavar="FILE")
    worker_tls_ca: str = server_flags.peer_tls_ca("the workers")
    worker_tls_cert: str = server_flags.peer_tls_cert("the workers")
    worker_tls_key: str = server_flags.peer_tls_key("--worker-tls-cert")
    worker_tls_server_name: str = option("", "the name the workers' certificates carry (default: the "
                                             "--workers-dns name): the gateway dials each worker's own "
                                             "address, which no certificate can list; alone, TLS on the "
                                             "system's roots", metavar="NAME")

    def __post_init__(self) -> None:
        check_deployment_salt(self.cache_salt)
        if self.workers_dns and ":" not in self.workers_dns:
            raise ValueError(f"--workers-dns must be NAME:PORT, got {self.workers_dns!r}")
        parse_flag("--listen", self.listen)   # empty too: refused before the tokenizer loads
        if self.health_listen:
            parse_flag("--health-listen", self.health_listen)
        check_tcp_listen("--http-listen", self.http_listen)
        server_flags.allowed_origins(self.http_allowed_origins)
        check_tcp_listen("--metrics-listen", self.metrics_listen)
        for flag, address in [*(("--worker", w) for w in self.worker),
                              *([("--workers-dns", self.workers_dns)] if self.workers_dns else [])]:
            check_dial(flag, address, "a worker")
        if not 0.01 <= self.poll_interval_s <= 60:   # what WatchServerStats allows a look's interval
            raise ValueError(f"--poll-interval must be from 0.01 to 60 seconds, got {self.poll_interval_s:g}")
        if not 0.1 <= self.dns_interval_s <= 86400:   # a tiny one re-resolved in a busy loop
            raise ValueError(f"--dns-interval must be from 0.1 to 86400 seconds, got {self.dns_interval_s:g}")
        if not self.no_worker_timeout_s > 0:
            raise ValueError("--no-worker-timeout must be positive")
        if self.max_request_bytes > MAX_REQUEST_BYTES:
            raise ValueError(f"--max-request-bytes must be at most {MAX_REQUEST_BYTES} (gRPC's limit), "
                             f"got {self.max_request_bytes}")
        for name in ("worker_queue_depth", "max_queued", "tokenizer_threads", "max_request_bytes", "max_prompt_chars",
                     "max_chat_messages", "max_n"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.balance_slack, int) or self.balance_slack < 0:
            raise ValueError(f"--balance-slack must be an integer >= 0, got {self.balance_slack!r}")
        if not isinstance(self.migration_limit, int) or self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be an integer >= 0, got {self.migration_limit!r}")
        if self.lane not in ("auto", "off"):
            raise ValueError(f"--lane must be auto or off, got {self.lane!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"--routing must be cache, round-robin or random, got {self.routing!r}")
        if not 0 <= self.overlap_weight < math.inf:   # NaN or inf made every cost NaN: no worker chosen
            raise ValueError(f"--overlap-weight must be a finite number, 0 or more, got {self.overlap_weight}")
        if not (0 <= self.grace_s < math.inf):   # NaN compares false: "nan" drained for no time at all
            raise ValueError(f"--grace-period must be a number of seconds, 0 or more, got {self.grace_s}")
        self.server_tls()
        self.worker_tls()

    def check_files(self) -> None:
        """Read every file the flags name: a wrong path fails at start, with a sentence."""
        server_flags.read_files(self.server_tls(), self.worker_tls(), api_keys=self.api_keys)

    def server_tls(self) -> ServerTLS | None:
        return ServerTLS.of(self.tls_cert, self.tls_key, self.tls_client_ca)

    def worker_tls(self) -> ClientTLS | None:
        tls = ClientTLS.of(self.worker_tls_ca, self.worker_tls_cert, self.worker_tls_key,
                           server_name=self.worker_tls_server_name, prefix="--worker-tls")
        if tls is not None and not tls.server_name and self.workers_dns:   # the pods' addresses are in no certificate
            tls = dataclasses.replace(tls, server_name=self.workers_dns.rsplit(":", 1)[0])
        return tls
