#!/usr/bin/env python
"""The CPU GEMMs by number of rows: where the native GEMM leads oneDNN and where it falls behind.

    .venv/bin/python bench/gemm_rows.py                       # 16 .. 2048 rows, float32
    .venv/bin/python bench/gemm_rows.py --rows 32 128 512 --rounds 21
    .venv/bin/python bench/gemm_rows.py --model PATH          # another checkpoint's shapes

The bench model's decoder-layer matmuls as the packed model runs them (bench/model_bench.py's
layer_matmuls: qkv fused, gate and up apart; the LM head left out: a prefill runs it on one row
per sequence), each layer's weights its own, so that every call reads its weights from memory
as a decode step does. At each row count, in rounds whose order rotates: the native GEMM on its
panels (kernels/cpu_gemm.c), oneDNN on its packed weights, oneDNN on the plain weights, and
F.linear (MKL on x86); the median time of all the calls, its GFLOP/s, and each one's time over
packed oneDNN's. model/linear.py's NATIVE_MAX_ROWS is where these cross.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.model_bench import layer_matmuls  # noqa: E402
from kvserve.model_service import host_memory  # noqa: E402
from kvserve.model_service.kernels import cpu_gemm, onednn  # noqa: E402
from kvserve.model_service.kernels.library import KernelUnavailable  # noqa: E402
from kvserve.model_service.model.config import ModelConfig  # noqa: E402
from kvserve.model_service.tiny_model import default_tiny_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 96, 128, 192, 256, 512, 2048])
    ap.add_argument("--rounds", type=int, default=11, help="rounds per row count (5 from 512 rows on)")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the generated bench model)")
    args = ap.parse_args()

    host_memory.keep_freed_memory()   # as the model service does: a GEMM's scratch memory reused, not faulted in
    torch.manual_seed(0)
    config = ModelConfig.from_pretrained(Path(args.model) if args.model else default_tiny_path("bench"))
    shapes = [(n, k) for k, n in layer_matmuls(config)]   # (out, in), as a weight is laid out
    weights = [torch.randn(n, k) / k ** 0.5 for n, k in shapes]
    try:
        native = cpu_gemm.load()
        panels = [native.pack(w) for w in weights]
    except KernelUnavailable as exc:   # AVX-512 only: the other columns still tell the rows apart
        native = None
        print(f"(native GEMM: not here, {exc})")
    if not onednn.onednn_available(torch.float32):
        sys.exit("oneDNN's linears do not run here")
    packed = [onednn.pack(w) for w in weights]
    flop_per_row = sum(2 * n * k for n, k in shapes)
    print(f"{len(shapes)} matmuls, {sum(w.numel() for w in weights) * 4 / 1e6:.0f} MB of float32 weights; "
          f"torch threads {torch.get_num_threads()}")
    columns = (["native"] if native else []) + ["oneDNN packed", "oneDNN on the plain weight", "F.linear"]
    print("| rows | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
        gemms = {
            **({"native": lambda i: native(xs[shapes[i][1]], panels[i])} if native else {}),
            "packed": lambda i: onednn.linear(xs[shapes[i][1]], packed[i], None),
            "plain": lambda i: onednn.matmul_nt(xs[shapes[i][1]], weights[i]),
            "F.linear": lambda i: F.linear(xs[shapes[i][1]], weights[i]),
        }
        times: dict[str, list[float]] = {name: [] for name in gemms}
        order = list(gemms)
        for r in range(args.rounds if rows < 512 else min(args.rounds, 5)):
            for name in order[r % len(order):] + order[:r % len(order)]:
                start = time.perf_counter()
                for i in range(len(shapes)):
                    gemms[name](i)
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t) for name, t in times.items()}
        cells = [f"{med[name] * 1e3:.2f} ms, {flop_per_row * rows / med[name] / 1e9:.0f} GFLOP/s, "
                 f"{med[name] / med['packed']:.2f}x" for name in gemms]
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
