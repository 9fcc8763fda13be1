"""The model service's one configuration: every field a flag of `kvserve model` and `kvserve up`
(services/plumbing/config_flags.py generates them), validated at construction.

manager_config() is the one place the manager's sizes come from, whether `kvserve up` starts
it as a process or the model service holds it in-process (`--kvcache inprocess`).
"""

from __future__ import annotations

import math
import re

from dataclasses import dataclass

from kvserve.kvcache_service.contract.hashing import check_deployment_salt
from kvserve.kvcache_service.core.config import ManagerConfig
from kvserve.model_service import choices
from kvserve.services.plumbing.address import check_dial, check_tcp_listen, is_private, parse_flag
from kvserve.services.plumbing import server_flags
from kvserve.services.plumbing.config_flags import MAX_REQUEST_BYTES, option, parse_bytes
from kvserve.services.plumbing.tls import ClientTLS, ServerTLS

DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_KVCACHE = "127.0.0.1:50061"
DTYPES = ("auto", *choices.DTYPES)
KV_CACHE_DTYPES = ("auto", *choices.KV_CACHE_DTYPES)
ATTENTION_BACKENDS = ("auto", *choices.ATTENTION_BACKENDS)
CPU_GEMMS = ("auto", *choices.CPU_GEMMS)
PREEMPTION_MODES = choices.PREEMPTION_MODES
SPECULATIVE = choices.SPECULATIVE
MIN_MANAGER_SEQS = 256   # seq ids are cheap; a pool this large never limits a small model service
UINT32_MAX = 2**32 - 1   # the largest count ModelInfo can say
MAX_MODEL_NAME = 256   # characters of --served-model-name
GENERATION_CONFIGS = ("auto", "none")


@dataclass(frozen=True)
class ModelServiceConfig:
    model: str = option("tiny", "a checkpoint directory, or a built-in model (tiny, bench, ...) generated "
                                "on first use")
    served_model_name: str = option("", "the model's name to clients (GetModelInfo, and what the HTTP API's `model` "
                                        "must say): default the --model directory's name, or the built-in model's")
    listen: str = option(DEFAULT_LISTEN, "the model service's address: host:port or unix:///path")
    kvcache: str = option(DEFAULT_KVCACHE, "the manager's address, or 'inprocess'")
    dtype: str = option("auto", "weights and KV pages (see --kv-cache-dtype); auto is bfloat16 on CUDA; on CPU the "
                           "checkpoint's bfloat16 where the CPU has bf16 instructions, else float32", choices=DTYPES)
    kv_cache_dtype: str = option("auto", "the KV pages' dtype; auto: the model's. bfloat16 under a float32 "
                                         "model (CPU): half the bytes a decode step reads, twice the tokens in "
                                         "the same memory, each K/V value rounded once", choices=KV_CACHE_DTYPES)
    device: str = option("auto", "cpu, cuda or cuda:N; auto is cuda where it is available")
    attention_backend: str = option("auto", "attention over the pages; auto is flash_attn on CUDA where it "
                                            "imports, cpu on CPU where its kernel loads, else torch",
                                    choices=ATTENTION_BACKENDS)
    cpu_threads: int = option(0, "CPU: threads for the model's math (0: one per core; under `kvserve up "
                                 "--workers N`, the cores shared out among the N); fewer leaves cores to "
                                 "the server's front (receiving, tokenizing) so a burst of large requests "
                                 "slows the engine less")
    cpu_gemm: str = option("auto", "what runs the matmuls on CPU; auto takes the first that runs here in "
                                   "kvserve's measured order", choices=CPU_GEMMS)
    cpu_small_linear: str = option("auto", "CPU: matmuls of at most 4 rows (decode steps of a few "
                                           "sequences; 32 for bfloat16 weights on a CPU without bfloat16 "
                                           "matmuls) on kvserve's small-batch kernel, near the memory "
                                           "bandwidth, such decode steps one native call per layer; with a "
                                           "packed GEMM it keeps the float32 weights twice. "
                                           "off: every matmul on --cpu-gemm", choices=("auto", "off"))
    page_size: int | None = option(None, "tokens per page (default: the attention backend's: 16; "
                                          "flash_attn 128 with flash-attn 4, 256 with flash-attn 2)")
    num_pages: int | None = option(None, "device KV pages (default: from the memory budget)")
    kv_cache_memory: int | None = option(None, "bytes for KV pages, e.g. 2GiB (default on CPU: 1GiB, at "
                                               "most what --max-num-seqs full-length sequences fill; "
                                               "profiled on CUDA)", parse=parse_bytes)
    gpu_memory_utilization: float = option(0.90, "CUDA: share of the GPU for weights, activations and pages")
    swap_pages: int = option(0, "CPU swap pages (preemption by swap); 0: recompute only")
    preemption_mode: str = option("recompute", "what a preempted sequence loses", choices=PREEMPTION_MODES)
    speculative: str = option("off", "speculative decoding: ngram drafts the next tokens from earlier ones "
                                     "(prompt lookup) and one forward verifies them", choices=SPECULATIVE)
    num_draft_tokens: int = option(4, "tokens a draft holds at most (--speculative)")
    attention_sink: int = option(0, "with a sliding-window model: keep the first S tokens in attention beside "
                                    "the window (StreamingLLM), and let a stream run past the model length; "
                                    "output then differs from the model's own attention", metavar="S")
    cuda_graph_max_batch: int = option(256, "CUDA with flash_attn: decode steps of up to this many sequences "
                                            "(and --max-num-seqs) replay a CUDA graph captured at start, one "
                                            "launch for the step's every kernel; 0: every step launches its "
                                            "kernels one by one", metavar="N")
    generation_config: str = option("auto", "sampling for what a request leaves unset (temperature, top_p, top_k, "
                                            "min_p, repetition_penalty): auto takes the checkpoint's "
                                            "generation_config.json where it has one; none: temperature 1, no "
                                            "filters", choices=GENERATION_CONFIGS)
    max_num_seqs: int = option(64, "sequences in one forward pass")
    max_num_batched_tokens: int = option(2048, "tokens in one forward pass; longer prompts are chunked")
    long_prefill_token_threshold: int = option(0, "a prompt's prefill takes at most this many tokens of a step, "
                                                  "leaving the rest of --max-num-batched-tokens to other prompts "
                                                  "(a short request is not held behind a long prompt); 0: a prompt "
                                                  "takes all the step leaves", metavar="N")
    max_waiting: int = option(1024, "queued requests before RESOURCE_EXHAUSTED")
    stream_interval: int = option(1, "stream a request's tokens in chunks of this many (the first at once); "
                                     "more is less per-message work for higher throughput, less smooth "
                                     "streaming")
    max_model_len: int | None = option(None, "default: the model's, capped by the page pool")
    cache_salt: str = option("", "keeps this deployment's prefix cache apart (default: none)")
    prefix_caching: bool = option(True, "never share KV pages between requests (for measurements)")
    kvcache_timeout_s: float = option(60.0, "seconds to wait for the manager at start", flag="--kvcache-timeout")
    manager_timeout_s: float = option(5.0, "seconds a lost manager may take to come back before the requests "
                                           "it held end with UNAVAILABLE (they wait, then go on, if it "
                                           "returns sooner); also the longest wait for one Step's answer",
                                      flag="--manager-timeout")
    stall_timeout_s: float = option(30.0, "seconds without a completed engine step, with requests in "
                                          "flight, before health says NOT_SERVING", flag="--stall-timeout")
    grace_s: float = option(5.0, "seconds to drain on SIGTERM: in-flight requests finish, then end "
                                 "with UNAVAILABLE", flag="--grace-period")
    metrics_listen: str = server_flags.metrics_listen()
    http_listen: str = server_flags.http_listen()
    http_allowed_origins: str = server_flags.http_allowed_origins()
    lane_listen: str = option("", "also serve Generate to a kvserve gateway on HOST:PORT or unix:PATH over the lane "
                                  "(protos/kvserve/inference/v1/lane.proto), a hop cheaper than gRPC; TLS as "
                                  "--tls-cert on TCP; not with --api-keys (default: off)", metavar="ADDR")
    # Security: TLS on TCP addresses, API keys, and the link to the manager.
    tls_cert: str = server_flags.tls_cert()
    tls_key: str = server_flags.tls_key()
    tls_client_ca: str = server_flags.tls_client_ca()
    health_listen: str = server_flags.health_listen()
    api_keys: str = option("", "file of `KEY TENANT` lines: every Inference call needs `authorization: Bearer "
                               "KEY`; each tenant's prefix cache is its own; re-read on SIGHUP", metavar="FILE")
    trust_tenant_metadata: bool = option(False, "take the tenant from `kvserve-tenant` metadata (a worker "
                                                "behind a gateway that checks keys; guard it with mutual TLS "
                                                "or a private address)")
    kvcache_tls_ca: str = server_flags.peer_tls_ca("the manager")
    kvcache_tls_cert: str = server_flags.peer_tls_cert("the manager")
    kvcache_tls_key: str = server_flags.peer_tls_key("--kvcache-tls-cert")
    kvcache_tls_server_name: str = option("", "the name the manager's certificate carries, when not its "
                                              "address's; alone, TLS on the system's roots", metavar="NAME")
    kvcache_token_file: str = option("", "file holding the manager's admin token, for a manager beyond this "
                                         "pod (its write RPCs refuse other callers)", metavar="FILE")
    # Limits on each request, checked before any work is done for it.
    max_request_bytes: int = option(8 << 20, "largest request message, e.g. 8MiB", parse=parse_bytes)
    max_prompt_chars: int = option(1_000_000, "longest prompt, or chat messages' text together, in characters")
    max_chat_messages: int = option(1024, "most messages in one chat request")
    max_stop_strings: int = option(64, "most stop strings in one request")
    max_logprobs: int = option(20, "most top logprobs a request may ask for per token")
    max_n: int = option(16, "most sequences one request may sample in parallel (SamplingParams.n)")
    max_unread_tokens: int = option(32768, "most tokens a stream's client may leave unread (each logprob asked "
                                           "counts one more) before its request is cancelled and the stream "
                                           "ends RESOURCE_EXHAUSTED")
    format_compile_timeout_s: float = option(10.0, "seconds a new structured-output format may take to compile "
                                                   "(checked in a child process, killed past it) before its "
                                                   "request is refused; 0: no bound, no child",
                                             flag="--format-compile-timeout")
    tokenizer_threads: int = option(2, "threads that tokenize and render chat templates, off the server's "
                                       "event loop")
    # `kvserve up` reads the pool size the model service chose here, to start the manager with it.
    sizing_file: str | None = option(None, "where to write {num_pages, page_size} once sized", hidden=True)
    ready_file: str | None = option(None, "a file touched once serving (registered with its manager): a "
                                          "launcher counts a run as steady from then", hidden=True)

    def __post_init__(self) -> None:
        check_deployment_salt(self.cache_salt)

        def positive(name: str, allow_none: bool = True) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")

        def one_of(name: str, allowed: tuple[str, ...]) -> None:
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be {', '.join(allowed[:-1])} or {allowed[-1]}, "
                                 f"got {value!r}")

        for name in ("page_size", "num_pages", "kv_cache_memory", "max_model_len"):
            positive(name)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "stream_interval",
                     "max_request_bytes", "max_prompt_chars", "max_chat_messages", "tokenizer_threads", "max_n",
                     "num_draft_tokens", "max_unread_tokens"):
            positive(name, allow_none=False)
        if self.max_model_len is not None and isinstance(self.max_model_len, int) and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2 (a prompt token and an output token), got "
                             f"{self.max_model_len}")
        for name in ("page_size", "num_pages", "max_model_len", "max_num_seqs", "max_waiting", "attention_sink"):
            value = getattr(self, name)   # ModelInfo says each as a uint32
            if isinstance(value, int) and value > UINT32_MAX:
                raise ValueError(f"--{name.replace('_', '-')} must be at most {UINT32_MAX}, got {value}")
        for name in ("max_stop_strings", "max_logprobs", "long_prefill_token_threshold"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 0, got {getattr(self, name)!r}")
        if not self.kvcache_timeout_s < 10**9:   # a deadline that far out is past what a timestamp holds
            raise ValueError(f"--kvcache-timeout must be under 1e9 seconds, got {self.kvcache_timeout_s}")
        if self.max_request_bytes > MAX_REQUEST_BYTES:
            raise ValueError(f"--max-request-bytes must be at most {MAX_REQUEST_BYTES} (gRPC's limit), "
                             f"got {self.max_request_bytes}")
        for name in ("kvcache_timeout_s", "manager_timeout_s", "stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.removesuffix('_s').replace('_', '-')} must be positive, "
                                 f"got {getattr(self, name)}")
        if not isinstance(self.attention_sink, int) or self.attention_sink < 0:
            raise ValueError(f"--attention-sink must be an integer >= 0, got {self.attention_sink!r}")
        if not (0 <= self.format_compile_timeout_s < 10**9):
            raise ValueError(f"--format-compile-timeout must be a number of seconds, 0 or more, "
                             f"got {self.format_compile_timeout_s}")
        if not (0 <= self.grace_s < math.inf):   # NaN compares false: "nan" drained for no time at all
            raise ValueError(f"--grace-period must be a number of seconds, 0 or more, got {self.grace_s}")
        if not isinstance(self.cuda_graph_max_batch, int) or self.cuda_graph_max_batch < 0:
            raise ValueError(f"--cuda-graph-max-batch must be an integer >= 0, got {self.cuda_graph_max_batch!r}")
        if not isinstance(self.cpu_threads, int) or not 0 <= self.cpu_threads <= 4096:
            raise ValueError(f"--cpu-threads must be an integer from 0 to 4096, got {self.cpu_threads!r}")
        if self.swap_pages < 0:
            raise ValueError(f"--swap-pages must not be negative, got {self.swap_pages}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.served_model_name and not (len(self.served_model_name) <= MAX_MODEL_NAME
                                           and self.served_model_name.isprintable()
                                           and self.served_model_name.strip() == self.served_model_name):
            raise ValueError(f"--served-model-name must be printable, with no space at either end, and at most "
                             f"{MAX_MODEL_NAME} characters, got {self.served_model_name!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(self.device)):   # (whether CUDA is here: at load)
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        one_of("dtype", DTYPES)
        one_of("kv_cache_dtype", KV_CACHE_DTYPES)
        one_of("attention_backend", ATTENTION_BACKENDS)
        one_of("cpu_gemm", CPU_GEMMS)
        one_of("cpu_small_linear", ("auto", "off"))
        one_of("preemption_mode", PREEMPTION_MODES)
        one_of("speculative", SPECULATIVE)
        one_of("generation_config", GENERATION_CONFIGS)
        if self.num_pages is not None and self.kv_cache_memory is not None:
            raise ValueError("--num-pages and --kv-cache-memory both size the page pool; give one")
        if self.attention_backend == "flash_attn" and self.device == "cpu":
            raise ValueError("--attention-backend flash_attn runs on CUDA only; on --device cpu choose auto, cpu "
                             "or torch")
        parse_flag("--listen", self.listen)   # empty too: refused before the model loads, not after
        if self.health_listen:
            parse_flag("--health-listen", self.health_listen)
        check_tcp_listen("--http-listen", self.http_listen)
        server_flags.allowed_origins(self.http_allowed_origins)
        check_tcp_listen("--metrics-listen", self.metrics_listen)
        if self.lane_listen:
            parse_flag("--lane-listen", self.lane_listen)
        if self.kvcache != "inprocess":
            check_dial("--kvcache", self.kvcache)
        if self.preemption_mode == "swap" and self.swap_pages == 0:
            raise ValueError("--preemption-mode swap needs --swap-pages > 0")
        if self.trust_tenant_metadata and not self.tls_client_ca and not is_private(self.listen):
            raise ValueError(f"--trust-tenant-metadata on {self.listen}: anyone who reaches it could name any "
                             "tenant; listen on a Unix socket or loopback, or accept only the gateway's "
                             "certificate (--tls-client-ca)")
        if (self.trust_tenant_metadata and self.http_listen and not self.tls_client_ca
                and not is_private(self.http_listen)):   # a worker behind a gateway checks no key
            raise ValueError(f"--trust-tenant-metadata with --http-listen {self.http_listen}: anyone who reaches it "
                             "would be served with no key; serve HTTP on loopback, at the gateway, or with "
                             "--tls-client-ca")
        if (self.kvcache_token_file and not self.kvcache_tls_ca and self.kvcache != "inprocess"
                and not self.kvcache.startswith("unix:")):
            raise ValueError("--kvcache-token-file: the admin token would cross the network in plaintext; "
                             "reach the manager over TLS (--kvcache-tls-ca)")
        if self.lane_listen and self.api_keys:
            raise ValueError("--lane-listen with --api-keys: the lane serves a gateway and checks no key; a worker "
                             "behind a gateway runs without --api-keys (with --trust-tenant-metadata)")
        if self.trust_tenant_metadata and self.lane_listen and not self.tls_client_ca and not is_private(self.lane_listen):
            raise ValueError(f"--trust-tenant-metadata with --lane-listen {self.lane_listen}: anyone who reaches it "
                             "could name any tenant; put the lane on a Unix socket or loopback, or accept only the "
                             "gateway's certificate (--tls-client-ca)")
        if self.api_keys and self.trust_tenant_metadata:
            raise ValueError("--api-keys and --trust-tenant-metadata: a front service checks keys, a worker "
                             "behind a gateway trusts its metadata; give one")
        self.server_tls()
        self.kvcache_tls()

    def check_files(self) -> None:
        """Read every file the flags name: a wrong path fails here, before the model loads."""
        server_flags.read_files(self.server_tls(), self.kvcache_tls(), api_keys=self.api_keys,
                                token_file=self.kvcache_token_file)

    def server_tls(self) -> ServerTLS | None:
        return ServerTLS.of(self.tls_cert, self.tls_key, self.tls_client_ca)

    def kvcache_tls(self) -> ClientTLS | None:
        return ClientTLS.of(self.kvcache_tls_ca, self.kvcache_tls_cert, self.kvcache_tls_key,
                            server_name=self.kvcache_tls_server_name, prefix="--kvcache-tls")

    def manager_config(self, num_pages: int, page_size: int, max_seqs: int | None = None) -> ManagerConfig:
        """The manager this model service needs, once its page pool is sized: the same pages,
        its swap pages, and seq ids for twice the sequences a step runs (running, swapped, and
        those released a step late by the pipelined engine), at least MIN_MANAGER_SEQS."""
        return ManagerConfig(num_pages=num_pages, page_size=page_size, cpu_pages=self.swap_pages,
                             max_seqs=max_seqs or max(MIN_MANAGER_SEQS, 2 * self.max_num_seqs))
