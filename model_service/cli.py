"""`kvserve model` (the model service alone, e.g. as a sidecar's partner) and
`kvserve up` (the manager and the model service as two processes, wired together)."""

from __future__ import annotations

import argparse

from kvserve.model_service.config import DEFAULT_KVCACHE, DEFAULT_LISTEN, ModelServiceConfig

_D = ModelServiceConfig()


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="a checkpoint directory, or a built-in model "
                   "(tiny, bench, ...) generated on first use (default tiny)")
    p.add_argument("--dtype", default=_D.dtype, help="auto | float32 | bfloat16 | float16 (default auto)")
    p.add_argument("--device", default=_D.device, help="auto | cpu | cuda[:N] (default auto)")
    p.add_argument("--attention-backend", default=_D.attention_backend, help="auto | torch | cpu | flash_attn")
    p.add_argument("--cpu-gemm", default=_D.cpu_gemm,
                   help="what runs the matmuls on CPU: auto | native | onednn | torch (default auto: "
                        "native in float32 where it builds, else oneDNN)")
    p.add_argument("--page-size", type=int, default=None, help="tokens per page (default 16; 256 for flash-attn 2)")
    p.add_argument("--num-pages", type=int, default=None, help="device KV pages (default: from the memory budget)")
    p.add_argument("--kv-cache-memory", type=_bytes, default=None,
                   help="bytes for KV pages, e.g. 2GiB (default 1GiB on CPU; profiled on CUDA)")
    p.add_argument("--gpu-memory-utilization", type=float, default=_D.gpu_memory_utilization,
                   help=f"CUDA: share of the GPU to use (default {_D.gpu_memory_utilization})")
    p.add_argument("--swap-pages", type=int, default=_D.swap_pages, help="CPU swap pages (default 0)")
    p.add_argument("--preemption-mode", default=_D.preemption_mode, help="recompute | swap")
    p.add_argument("--max-num-seqs", type=int, default=_D.max_num_seqs,
                   help=f"sequences per step (default {_D.max_num_seqs})")
    p.add_argument("--max-num-batched-tokens", type=int, default=_D.max_num_batched_tokens,
                   help=f"tokens per step; longer prompts are chunked (default {_D.max_num_batched_tokens})")
    p.add_argument("--max-waiting", type=int, default=_D.max_waiting,
                   help=f"queued requests before RESOURCE_EXHAUSTED (default {_D.max_waiting})")
    p.add_argument("--stream-interval", type=int, default=_D.stream_interval,
                   help="stream a request's tokens in chunks of this many (the first at once); "
                        "more is less per-message work for higher throughput, less smooth "
                        f"streaming (default {_D.stream_interval})")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--cache-salt", default="", help="keeps this deployment's prefix cache apart")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="never share KV pages between requests (for measurements)")
    p.add_argument("--grace-period", type=float, default=_D.grace_s, help="seconds to drain on SIGTERM")


def model_config(args: argparse.Namespace, **override) -> ModelServiceConfig:
    fields = dict(
        model=args.model, listen=args.listen, kvcache=args.kvcache, dtype=args.dtype, device=args.device,
        attention_backend=args.attention_backend, cpu_gemm=args.cpu_gemm, page_size=args.page_size, num_pages=args.num_pages,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        swap_pages=args.swap_pages, preemption_mode=args.preemption_mode, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_waiting=args.max_waiting,
        stream_interval=args.stream_interval, max_model_len=args.max_model_len, cache_salt=args.cache_salt,
        prefix_caching=args.prefix_caching, grace_s=args.grace_period)
    fields.update(override)
    try:
        return ModelServiceConfig(**fields)
    except ValueError as exc:
        raise SystemExit(f"kvserve: {exc}") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("model", help="run the model service alone",
                              description="Run the model service; the KV-cache manager runs elsewhere.")
    p.add_argument("--listen", default=DEFAULT_LISTEN, help=f"host:port or unix:///path (default {DEFAULT_LISTEN})")
    p.add_argument("--kvcache", default=DEFAULT_KVCACHE,
                   help=f"the manager's address, or 'inprocess' (default {DEFAULT_KVCACHE})")
    p.add_argument("--sizing-file", default=None, help=argparse.SUPPRESS)  # kvserve up reads the pool size here
    add_model_arguments(p)
    p.set_defaults(func=run_model)


def run_model(args: argparse.Namespace) -> int:
    import asyncio

    from kvserve.model_service.server import serve

    try:
        asyncio.run(serve(model_config(args, sizing_file=args.sizing_file)))
    except (ValueError, ConnectionError) as exc:  # bad model/config, manager refused or unreachable
        raise SystemExit(f"kvserve model: {exc}") from None
    return 0


def _bytes(text: str) -> int:
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "kib": 2**10, "mib": 2**20, "gib": 2**30}
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    try:
        return int(float(num) * units[t[len(num):]])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB, 1000000)") from None
