"""The model service's one configuration, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_KVCACHE = "127.0.0.1:50061"


@dataclass(frozen=True)
class ModelServiceConfig:
    model: str = "tiny"                   # "tiny" (generated on first use), a preset name, or a checkpoint dir
    listen: str = DEFAULT_LISTEN
    kvcache: str = DEFAULT_KVCACHE        # the manager's address, or "inprocess"
    dtype: str = "auto"                   # float32 | bfloat16 | float16; auto: bf16 on CUDA, fp32 on CPU
    device: str = "auto"                  # cpu | cuda | cuda:N; auto: cuda when available
    attention_backend: str = "auto"       # auto | torch | cpu | flash_attn
    cpu_gemm: str = "auto"                # auto | native | onednn | torch: what runs the matmuls on CPU
    page_size: int | None = None          # tokens per page; None: 16, or 256 for flash-attn 2
    num_pages: int | None = None          # device pages; None: from the memory budget below
    kv_cache_memory: int | None = None    # bytes for KV pages; None: 1 GiB on CPU, profiled on CUDA
    gpu_memory_utilization: float = 0.90  # CUDA: share of the GPU for weights + activations + pages
    swap_pages: int = 0                   # CPU swap pages (preemption by swap); 0: recompute only
    preemption_mode: str = "recompute"    # recompute | swap
    max_num_seqs: int = 64                # sequences in one forward pass
    max_num_batched_tokens: int = 2048    # tokens in one forward pass (chunked prefill splits longer prompts)
    max_waiting: int = 1024               # queued requests before RESOURCE_EXHAUSTED
    stream_interval: int = 1              # tokens per streamed chunk; the first token goes out at once
    max_model_len: int | None = None      # None: the model's, capped by the page pool
    cache_salt: str = ""                  # extra_key: keeps this deployment's prefix cache apart
    prefix_caching: bool = True           # off: every request's pages are keyed apart (no hits)
    kvcache_timeout_s: float = 60.0       # how long to wait for the manager at start
    grace_s: float = 5.0                  # SIGTERM drain
    sizing_file: str | None = None        # where to write {"num_pages", "page_size"} once sized (kvserve up)

    def __post_init__(self) -> None:
        def positive(name: str, allow_none: bool = True) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")

        for name in ("page_size", "num_pages", "kv_cache_memory", "max_model_len"):
            positive(name)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "stream_interval"):
            positive(name, allow_none=False)
        if self.swap_pages < 0:
            raise ValueError(f"--swap-pages must not be negative, got {self.swap_pages}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "cpu", "flash_attn"):
            raise ValueError(f"--attention-backend must be auto, torch, cpu or flash_attn, got {self.attention_backend!r}")
        if self.cpu_gemm not in ("auto", "native", "onednn", "torch"):
            raise ValueError(f"--cpu-gemm must be auto, native, onednn or torch, got {self.cpu_gemm!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"--preemption-mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.swap_pages == 0:
            raise ValueError("--preemption-mode swap needs --swap-pages > 0")
