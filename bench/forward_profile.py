#!/usr/bin/env python
"""Where a decode step's forward spends its time on the host: the launch time the engine's
"forward" phase measures on a GPU (the call returns before the kernels finish) against the step
with the GPU's work, the attention backend's share of the host time, and the torch ops that take
the most host time.

    python bench/forward_profile.py --device cuda --preset bench-1b --batch 256 --context 700
    python bench/forward_profile.py --device cuda --preset bench-1b --batch 256 --cuda-graphs   # replayed
    .venv/bin/python bench/forward_profile.py --device cpu --preset tiny --batch 64   # the logic on CPU

One decode batch (every sequence one token, `--context` tokens already in its pages), built by
the engine's ModelRunner, run `--steps` times after a warm-up. Printed: host time per step (until
the forward returns), wall time per step (until the device is done), the attention backend's
host time (its forward calls, all layers), and torch.profiler's top ops by host self time for one
step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu_bench import sync  # noqa: E402
from kvserve.model_service.tiny_model import make_preset  # noqa: E402


class TimedBackend:
    """The backend, with the host time of its forward calls added up."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.seconds = 0.0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.backend.forward(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench-1b")
    ap.add_argument("--model", type=Path, default=None, help="a checkpoint directory instead of a preset")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the pages' dtype (as the model service's option)")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=700)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cuda-graphs", action="store_true", help="the step replayed from a CUDA graph, as the "
                    "model service runs decode steps (engine/decode_graphs.py)")
    args = ap.parse_args()

    from kvserve.model_service.attention.select import select_backend
    from kvserve.model_service.dtype_choice import pick_kv_cache_dtype
    from kvserve.model_service.engine.runner import ModelRunner
    from kvserve.model_service.engine.scheduler import Work
    from kvserve.model_service.kv_cache import KVCache
    from kvserve.model_service.model.loader import load_model

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="kvserve-profile-") as tmp:
        path = args.model or make_preset(Path(tmp) / args.preset, args.preset)
        model, cfg = load_model(path, dtype, device)
    backend = select_backend(args.attention_backend, device, None, dtype, cfg.num_heads * cfg.head_dim,
                             model.lm_head.gemm)
    page_size = backend.default_page_size()
    per_seq = -(-(args.context + 1) // page_size)
    kv_dtype = pick_kv_cache_dtype(args.kv_cache_dtype, dtype, device)
    kv = KVCache(cfg, args.batch * per_seq, page_size, kv_dtype, device, spare_page=args.cuda_graphs)
    timed = TimedBackend(backend)
    graphs = None
    if args.cuda_graphs:
        from kvserve.model_service.engine.decode_graphs import DecodeGraphs, graph_safe

        if not graph_safe(backend):
            sys.exit(f"--cuda-graphs: the {backend.name} backend reads host-side lengths; a graph would freeze them")
        graphs = DecodeGraphs(model, backend, kv, page_size, args.batch, per_seq * page_size, device,
                              capture=device.type == "cuda", sizes=[args.batch])
        print(f"captured {len(graphs.sizes)} graphs in {graphs.capture():.1f} s")
    runner = ModelRunner(model, timed, kv, page_size, device, graphs)
    work = [Work(SimpleNamespace(tokens=[3] * (args.context + 1),
                                 page_table=list(range(i * per_seq, (i + 1) * per_seq))), args.context, 1)
            for i in range(args.batch)]
    for _ in range(3):   # warm-up: kernels compiled on first use, allocator grown
        runner.execute(work)
    sync(device)
    host, wall = [], []
    timed.seconds = 0.0
    for _ in range(args.steps):
        sync(device)
        start = time.perf_counter()
        runner.execute(work)
        host.append(time.perf_counter() - start)
        sync(device)
        wall.append(time.perf_counter() - start)
    attention = timed.seconds / args.steps
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        runner.execute(work)
        sync(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}; {path.name}, {args.dtype}, pages {kv_dtype}, backend {backend.name}"
          f"{' from CUDA graphs' if graphs else ''}, page size "
          f"{page_size}; {args.batch} sequences x {args.context} tokens of context; {cfg.num_layers} layers")
    h, w = statistics.median(host), statistics.median(wall)
    print(f"host (until forward returns) {1e3 * h:.2f} ms/step, wall (device done) {1e3 * w:.2f} ms/step; "
          f"per layer {1e3 * h / cfg.num_layers:.3f} ms host")
    print(f"attention backend's forward calls: {1e3 * attention:.2f} ms/step host ({100 * attention / h:.0f} % "
          f"of the host time), {1e3 * attention / cfg.num_layers:.3f} ms per layer")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    if device.type == "cuda":   # the device's side: which kernels the step's GPU time goes to
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
