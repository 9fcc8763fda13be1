"""Builds the model service's parts from its config: model, attention backend,
page pool, the link to the KV-cache manager, and the engine."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.kvcache_service.contract.types import PreemptionMode
from kvserve.kvcache_service.core.manager import KVCacheManager
from kvserve.model_service.attention.select import select_backend
from kvserve.model_service.config import ModelServiceConfig
from kvserve.model_service.engine.decode_graphs import DecodeGraphs, graph_safe
from kvserve.model_service.engine.engine import Engine
from kvserve.kvcache_service.contract.client import InProcessKVClient, KVClient, RemoteKVClient
from kvserve.model_service.engine.runner import ModelRunner
from kvserve.model_service.engine.scheduler import SchedulerConfig
from kvserve.model_service.engine.speculation import NgramDrafter
from kvserve.model_service import generation_defaults
from kvserve.model_service.generation_defaults import GenerationDefaults
from kvserve.model_service.kv_cache import KVCache
from kvserve.model_service.model.loader import check_config, first_line, load_model
from kvserve.model_service.sampling.sampler import Sampler
from kvserve.model_service.sampling.structured import Grammars
from kvserve.model_service import dummy_step, host_memory, sizing
from kvserve.model_service.dtype_choice import checkpoint_dtype, pick_dtype, pick_kv_cache_dtype
from kvserve.model_service.token_bytes import token_bytes
from kvserve.model_service.prompt_tokens import (keeps_message_text, load_tokenizer, resolve_model_path,
                                                 tokenizer_digest)
from kvserve.services.plumbing.api_keys import read_token

log = logging.getLogger(__name__)


@dataclass
class ModelStack:
    config: ModelServiceConfig
    model_path: Path
    model_config: object
    tokenizer: object
    engine: Engine
    kv: KVClient
    device: torch.device
    dtype: torch.dtype
    backend_name: str
    gemm: str                      # what runs the matmuls: native | onednn | torch (model/linear.py)
    page_size: int
    num_pages: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    kv_cache_dtype: torch.dtype    # the pages' (--kv-cache-dtype): the model's, or narrower
    grammars: Grammars             # structured output's formats for this model's vocabulary
    tokenizer_digest: str          # what its tokenizer does, for a gateway to compare (prompt_tokens.py)
    generation_defaults: GenerationDefaults = GenerationDefaults()   # sampling for what a request leaves unset
    chat_keeps_text: bool = True   # its chat template renders each message's text whole (prompt_tokens.py)
    token_bytes: Callable[[int], bytes] | None = None   # what each token stands for, in bytes (token_bytes.py)


def pick_device(name: str) -> torch.device:
    """`name` as ModelServiceConfig checked its form; whether CUDA is here is known only now."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but CUDA is not available here")
    return device


def build(cfg: ModelServiceConfig, on_step_end: Callable[[], None] = lambda: None) -> ModelStack:
    """on_step_end: what the engine calls after each pass of its loop (the servicer's event relay)."""

    path = resolve_model_path(cfg.model)
    # config.json, the tokenizer and its chat template first: one that does not read, or a template
    # that does not render, is said at once, not minutes into a large model's start.
    check_config(path)
    tokenizer = load_tokenizer(path)
    chat_keeps_text = keeps_message_text(tokenizer)
    bytes_of = token_bytes(tokenizer)   # (read on a thread of its own while the model loads)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device, checkpoint_dtype(path))
    kv_dtype = pick_kv_cache_dtype(cfg.kv_cache_dtype, dtype, device)   # before the model loads: a wrong pair fails fast
    if device.type == "cpu":
        host_memory.keep_freed_memory()   # before the first big allocation
        if cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)   # process-wide: the engine thread's too
    model, mcfg = load_model(path, dtype, device, cfg.cpu_gemm,
                             small_linear=cfg.cpu_small_linear == "auto")
    window = mcfg.sliding_window
    if cfg.attention_sink and not window:
        raise ValueError("--attention-sink keeps the first tokens beside a sliding window; this model has none "
                         "on every layer")
    try:
        backend = select_backend(cfg.attention_backend, device, cfg.page_size, dtype,
                                 mcfg.num_heads * mcfg.head_dim, model.lm_head.gemm,
                                 windowed=any(mcfg.layer_windows))
        multiple = backend.page_size_multiple()
        page_size = cfg.page_size or backend.default_page_size()
        if page_size % multiple:
            raise ValueError(f"--page-size {page_size}: the {backend.name} backend needs a multiple of {multiple}")
        backend.set_window(window, cfg.attention_sink, page_size, mcfg.layer_windows)
    except RuntimeError as exc:   # a backend asked for by name that cannot run this model here: a config error
        if cfg.attention_backend == "auto":
            raise
        raise ValueError(f"--attention-backend {cfg.attention_backend}: {exc}") from exc

    model_len = min(cfg.max_model_len or mcfg.max_model_len, mcfg.max_model_len)   # the flag, never past the model's
    if cfg.num_pages is not None:
        num_pages = cfg.num_pages
    elif device.type == "cuda":
        num_pages = sizing.cuda_pages(model, mcfg, backend, kv_dtype, device, page_size,
                                      cfg.max_num_batched_tokens, cfg.gpu_memory_utilization,
                                      cfg.kv_cache_memory)
    else:
        num_pages = sizing.cpu_pages(mcfg, kv_dtype, page_size, cfg.kv_cache_memory, cfg.max_num_seqs, model_len,
                                     sizing.window_min_pages(window, cfg.attention_sink, model_len, page_size))
    if device.type == "cpu":   # CUDA's profile run (sizing) has done the same
        dummy_step.warm_up(model, mcfg, backend, kv_dtype, device, page_size,
                           min(cfg.max_num_batched_tokens, model_len))
    max_chunk = None
    if window:   # pages past the window go back as a sequence runs: it holds a bounded number
        held = sizing.window_held(window, cfg.attention_sink, model_len)
        max_chunk = (num_pages * page_size - held - cfg.attention_sink) // 2 - 2 * page_size
        if max_chunk < page_size:
            need = sizing.window_min_pages(window, cfg.attention_sink, model_len, page_size)
            sink = f" and --attention-sink {cfg.attention_sink}'s" if cfg.attention_sink else ""
            raise ValueError(f"{num_pages} pages of {page_size} tokens are too few for this model's "
                             f"{window}-token sliding window: a sequence may hold {held} tokens' pages{sink} "
                             f"and two chunks'; at least {need} are needed (--num-pages, or more --kv-cache-memory"
                             f"{', or a smaller --attention-sink' if sink else ''})")
        max_model_len = model_len
    else:
        max_model_len = min(model_len, num_pages * page_size)
    if cfg.long_prefill_token_threshold:
        max_chunk = min(max_chunk or cfg.long_prefill_token_threshold, cfg.long_prefill_token_threshold)
    if max_model_len < model_len:
        log.warning("max_model_len capped at %d: the page pool holds no more", max_model_len)
    use_graphs = device.type == "cuda" and cfg.cuda_graph_max_batch > 0 and graph_safe(backend)
    try:
        model.rope.reserve(-(-max_model_len // page_size) * page_size)   # every position served, whole pages
        kv_cache = KVCache(mcfg, num_pages, page_size, kv_dtype, device, cpu_pages=cfg.swap_pages,
                           spare_page=use_graphs)
    except (MemoryError, OSError, RuntimeError) as exc:   # torch's allocators say it as any of these
        raise ValueError(f"cannot allocate the KV cache of {num_pages} pages of {page_size} tokens (and "
                         f"{cfg.swap_pages} swap pages): {first_line(exc)}; give fewer (--num-pages, "
                         "--kv-cache-memory, --page-size, --swap-pages)") from None
    if cfg.sizing_file:   # only once the pool exists: a launcher sizes the manager by it
        _write_atomically(cfg.sizing_file, {"num_pages": num_pages, "page_size": page_size})

    graphs = _capture_graphs(model, backend, kv_cache, page_size, min(cfg.cuda_graph_max_batch, cfg.max_num_seqs),
                             max_model_len, device) if use_graphs else None
    kv = _connect(cfg, num_pages, page_size)
    eos_ids = eos_ids_of(mcfg, tokenizer)

    mode = PreemptionMode.SWAP if cfg.preemption_mode == "swap" else PreemptionMode.RECOMPUTE
    engine = Engine(
        ModelRunner(model, backend, kv_cache, page_size, device, graphs),
        Sampler(eos_ids),
        tokenizer,
        eos_ids,
        kv,
        SchedulerConfig(page_size, cfg.max_num_seqs, cfg.max_num_batched_tokens, mode, window, cfg.attention_sink,
                        max_chunk),
        num_pages=num_pages,
        max_waiting=cfg.max_waiting,
        stream_interval=cfg.stream_interval,
        manager_timeout_s=cfg.manager_timeout_s,
        stall_timeout_s=cfg.stall_timeout_s,
        on_step_end=on_step_end,
        drafter=NgramDrafter(cfg.num_draft_tokens) if cfg.speculative == "ngram" else None,
        cpu_pages=kv_cache.num_cpu_pages,
    )
    log.info("model %s (%s, %s, %s): %d pages of %d tokens (%s), backend %s, GEMM %s, max_model_len %d%s",
             path.name, mcfg.architecture, dtype, device, num_pages, page_size, kv_dtype, backend.name,
             model.lm_head.gemm, max_model_len,
             f", decode steps of up to {graphs.max_batch} sequences from CUDA graphs" if graphs else "")
    if len(tokenizer) > mcfg.vocab_size:
        log.warning("the tokenizer has %d tokens, more than the model's vocabulary (%d): a prompt that uses the "
                    "others is refused", len(tokenizer), mcfg.vocab_size)
    return ModelStack(cfg, path, mcfg, tokenizer, engine, kv, device, dtype, backend.name, model.lm_head.gemm,
                      page_size, num_pages, max_model_len, eos_ids, kv_dtype,
                      Grammars(tokenizer, mcfg.vocab_size, eos_ids, cfg.format_compile_timeout_s), tokenizer_digest(tokenizer),
                      generation_defaults.load(path, cfg.generation_config), chat_keeps_text=chat_keeps_text,
                      token_bytes=bytes_of)


def _capture_graphs(model, backend, kv_cache, page_size: int, max_batch: int, max_model_len: int,
                    device: torch.device) -> DecodeGraphs | None:
    """Decode steps' CUDA graphs, or None (every step eager) where capturing fails: a kernel that
    cannot be captured must not keep the model service from serving."""
    before = torch.cuda.memory_allocated(device)
    try:
        graphs = DecodeGraphs(model, backend, kv_cache, page_size, max_batch, max_model_len, device)
        seconds = graphs.capture()
    except Exception as exc:   # noqa: BLE001 - whatever the kernels raise, eager steps still serve
        log.warning("capturing decode steps as CUDA graphs failed (%s: %s); every step runs eagerly",
                    type(exc).__name__, exc)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return None
    log.info("captured %d CUDA graphs of decode steps (1 to %d sequences) in %.1f s, %.0f MiB",
             len(graphs.sizes), graphs.max_batch, seconds,
             (torch.cuda.memory_allocated(device) - before) / 2**20)
    return graphs


def build_on_a_thread_that_ends(cfg: ModelServiceConfig, on_step_end: Callable[[], None] = lambda: None) -> ModelStack:
    """build(), on a thread of its own that ends once it returns.

    A thread that ran torch keeps an idle OpenMP pool while it lives, and with more OpenMP
    threads than cores libgomp stops spinning between parallel regions, so every region of
    the engine thread's forward waited to wake its workers (docs/benchmarks.md). The
    caller's thread runs no torch here."""
    box: dict[str, ModelStack | BaseException] = {}

    def run() -> None:
        try:
            box["stack"] = build(cfg, on_step_end)
        except BaseException as exc:   # raised again on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="kvserve-build", daemon=True)   # Ctrl-C need not wait for it
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["stack"]


def _connect(cfg: ModelServiceConfig, num_pages: int, page_size: int) -> KVClient:
    if cfg.kvcache == "inprocess":
        return InProcessKVClient(KVCacheManager(cfg.manager_config(num_pages, page_size)))
    client = RemoteKVClient(cfg.kvcache, timeout_s=cfg.manager_timeout_s, tls=cfg.kvcache_tls(),
                            token=read_token(cfg.kvcache_token_file))
    client.wait_ready(cfg.kvcache_timeout_s)
    return client


def eos_ids_of(mcfg, tokenizer) -> frozenset[int]:
    """The model's end-of-sequence ids (its config's and its tokenizer's) that it can sample: one
    past its vocabulary (a tokenizer's added token) is never drawn, and masking it for a request's
    min_tokens indexed past the logits, failing the whole batch."""
    eos = set(mcfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    outside = sorted(t for t in eos if not 0 <= t < mcfg.vocab_size)
    if outside:
        log.warning("end-of-sequence ids %s are outside the model's vocabulary [0, %d): the model cannot "
                    "sample them", outside, mcfg.vocab_size)
    return frozenset(t for t in eos if 0 <= t < mcfg.vocab_size)


def _write_atomically(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
