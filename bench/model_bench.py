#!/usr/bin/env python
"""Benchmark of the model forward on the `bench` preset (Llama, hidden 512, 8 layers,
8 q / 2 KV heads, head_dim 64, vocab 32000), float32, CPU; decode on the torch and the cpu
attention backends.

    .venv/bin/python bench/model_bench.py               # ~1 min on 2 cores (first run builds the model)
    .venv/bin/python bench/model_bench.py --threads 1   # steadier when other work shares the cores
    .venv/bin/python bench/model_bench.py --cpu-gemm onednn   # the model on the other packed GEMM

0. GEMMs: each matmul shape of the model at 2048 and 32 rows, F.linear against the
   packed GEMMs the model service runs on CPU (oneDNN, native), weights hot; then a decode
   step's 41 matmuls one after the other at 32 rows, weights cold as in the model.
1. Decode step: 32 sequences, contexts 64..544 (evenly spaced), page 16, shuffled pages.
   For each CPU attention backend (torch: page gather + SDPA; cpu: the native paged
   kernel), time per step, split into attention (backend.forward), the nn.Linear GEMMs,
   and the rest; then the per-layer decode attention against the plain peer (a
   Python loop over sequences, K/V heads repeated).
2. Prefill: one 512-token prompt; tokens/s, against transformers' forward on the
   same prompt in the same process.
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

from kvserve.model_service.attention.select import select_backend  # noqa: E402
from kvserve.model_service.attention.select import torch_attention  # noqa: E402
from kvserve.model_service.kv_cache import KVCache  # noqa: E402
from kvserve.model_service.model.linear import Linear  # noqa: E402
from kvserve.model_service.model.loader import load_model  # noqa: E402
from kvserve.model_service.tiny_model import default_tiny_path  # noqa: E402
from tests.model.paged import Chunk, PagePool, Sequence, build_batch  # noqa: E402

PAGE = 16


class Timer:
    """Wall time spent inside wrapped calls (the forward runs on one thread, so no overlap)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def best_ms(fn, repeat: int) -> float:
    """The fastest of `repeat` runs: the figure least disturbed by other work on the machine."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def decode_batch(contexts: list[int], vocab: int):
    pool = PagePool(sum(-(-c // PAGE) for c in contexts) + 64, seed=0)
    g = torch.Generator().manual_seed(0)
    chunks = []
    for c in contexts:
        seq = Sequence(torch.randint(7, vocab, (c,), generator=g).tolist(), computed=c - 1)
        seq.reserve(pool, PAGE, c)
        chunks.append(Chunk(seq, 1))
    return build_batch(chunks, len(chunks), pool, PAGE), len(pool.free) + sum(
        len(ch.seq.pages) for ch in chunks)


def bench_decode(model, config, repeat: int, backend_name: str) -> None:
    contexts = [round(64 + i * (544 - 64) / 31) for i in range(32)]
    batch, num_pages = decode_batch(contexts, config.vocab_size)
    cache = KVCache(config, num_pages, PAGE)
    cache.pool.normal_()
    try:
        backend = select_backend(backend_name, "cpu", PAGE, torch.float32)
    except RuntimeError as exc:
        print(f"decode step, {backend_name} backend: not here ({exc})")
        return

    def step():
        return model(batch, cache.layers, backend, backend.prepare(batch))

    plain = median_ms(step, repeat)
    # The split comes from the same runs as its total, so that the parts add up
    # even when other work on the machine slows some runs down.
    attn, gemm, whole = Timer(), Timer(), Timer()
    backend.forward = attn.wrap(backend.forward)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    forms = ("forward", "silu", "mul", "add")   # the plain matmul and the fused ones
    for m in linears:
        for form in forms:
            setattr(m, form, gemm.wrap(getattr(m, form)))
    timed_step = whole.wrap(step)
    for _ in range(repeat):
        timed_step()
    for m in linears:
        for form in forms:
            delattr(m, form)
    del backend.forward
    total, attn_ms, gemm_ms = (t.seconds / repeat * 1e3 for t in (whole, attn, gemm))
    lm_head_ms = median_ms(lambda: model.lm_head(torch.randn(32, config.hidden_size)), repeat)
    print(f"decode step, {backend.name} backend, 32 seqs, contexts {contexts[0]}..{contexts[-1]} (page {PAGE}):")
    print(f"  step  {plain:7.2f} ms  = {32 / plain * 1e3:6.0f} tok/s (median of {repeat}; "
          f"best {best_ms(step, repeat):.2f} ms)")
    print(f"  split of {repeat} timed steps, mean {total:.2f} ms:")
    print(f"    GEMMs {gemm_ms:7.2f} ms  ({gemm_ms / total:.0%}; the LM head alone {lm_head_ms:.2f} ms)")
    print(f"    attn  {attn_ms:7.2f} ms  ({attn_ms / total:.0%}; {attn_ms / config.num_layers:.2f} ms/layer "
          "incl. cache write)")
    print(f"    other {total - gemm_ms - attn_ms:7.2f} ms  (norms, rope, residuals, embedding, prepare)")
    bench_decode_attention_peer(config, batch, cache, backend, repeat)


def bench_decode_attention_peer(config, batch, cache, backend, repeat: int) -> None:
    """One layer's decode attention: ours vs a Python loop over sequences, the obvious way."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(32, config.num_heads, config.head_dim, generator=g)
    k = torch.randn(32, config.num_kv_heads, config.head_dim, generator=g)
    v = torch.randn_like(k)
    k_cache, v_cache = cache.layers[0]
    scale = config.head_dim ** -0.5
    meta = backend.prepare(batch)
    groups = config.num_heads // config.num_kv_heads

    def ours():
        return backend.forward(q, k, v, k_cache, v_cache, meta, scale)

    def loop():
        flat_k = k_cache.view(-1, config.num_kv_heads, config.head_dim)
        flat_k.index_copy_(0, batch.slot_mapping, k)
        v_cache.view_as(flat_k).index_copy_(0, batch.slot_mapping, v)
        out = []
        for i, length in enumerate(batch.seq_lens_cpu):
            pages = batch.block_tables[i, :-(-length // PAGE)].long()
            keys = k_cache[pages].flatten(0, 1)[:length].repeat_interleave(groups, 1).transpose(0, 1)
            vals = v_cache[pages].flatten(0, 1)[:length].repeat_interleave(groups, 1).transpose(0, 1)
            out.append(F.scaled_dot_product_attention(q[i][:, None], keys, vals, scale=scale)[:, 0])
        return torch.stack(out)

    torch.testing.assert_close(ours(), loop(), rtol=1e-4, atol=1e-4)
    ours_ms, loop_ms = median_ms(ours, repeat), median_ms(loop, repeat)
    ours_best, loop_best = best_ms(ours, repeat), best_ms(loop, repeat)
    print(f"  one layer's decode attention: {backend.name} backend {ours_ms:.2f} ms (best {ours_best:.2f}), "
          f"per-sequence loop {loop_ms:.2f} ms (best {loop_best:.2f}); loop/{backend.name} {loop_ms / ours_ms:.1f}x")


def bench_prefill(model, config, path: Path, repeat: int) -> None:
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(7, config.vocab_size, (512,), generator=torch.Generator().manual_seed(2))
    cache = KVCache(config, 512 // PAGE + 1, PAGE)
    backend = torch_attention()

    def ours():
        batch = build_batch([Chunk(Sequence(tokens.tolist()), 512)], 0, PagePool(512 // PAGE + 1), PAGE)
        return model(batch, cache.layers, backend, backend.prepare(batch))

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def theirs():
        with torch.inference_mode():
            return hf(tokens[None], logits_to_keep=1).logits[0, -1]

    torch.testing.assert_close(ours()[0], theirs(), rtol=1e-3, atol=1e-3)
    ours_ms, hf_ms = median_ms(ours, repeat), median_ms(theirs, repeat)
    print(f"prefill, one 512-token prompt: {ours_ms:.1f} ms = {512 / ours_ms * 1e3:,.0f} tok/s; "
          f"transformers {hf_ms:.1f} ms = {512 / hf_ms * 1e3:,.0f} tok/s (ours {hf_ms / ours_ms:.2f}x)")


def gemm_seconds(k: int, n: int, rows: int, gemm: str, repeat: int) -> float:
    """Fastest of `repeat` calls of a bias-free (rows, k) x (k -> n) Linear, plain ("torch":
    F.linear) or packed ("onednn", "native"): the call least disturbed by anything else."""
    x, linear = torch.randn(rows, k), Linear(k, n, bias=False)
    if gemm != "torch":
        linear.pack(gemm)
    with torch.inference_mode():
        return best_ms(lambda: linear(x), repeat) / 1e3


def packed_gemms() -> list[str]:
    """The packed CPU GEMMs that run here (model/linear.py)."""
    from kvserve.model_service.kernels.gemm import choose_gemm

    out = []
    for name in ("onednn", "native"):
        try:
            out.append(choose_gemm(name, torch.float32, torch.device("cpu")))
        except ValueError as exc:
            print(f"({name} GEMM: not here, {exc})")
    return out


def layer_matmuls(config) -> list[tuple[int, int]]:
    """(in, out) of every decoder layer's matmul as the packed model runs them, layer by layer:
    qkv fused; gate and up two matmuls once packed (model/layers.py); no LM head."""
    h, i = config.hidden_size, config.intermediate_size
    layer = [(h, config.q_size + 2 * config.kv_size), (config.q_size, h), (h, i), (h, i), (i, h)]
    return layer * config.num_layers


def bench_gemms(config, repeat: int) -> None:
    """Each of the model's matmul shapes, F.linear (MKL on x86) against each packed GEMM, weights
    hot; then a decode step's matmuls one after the other, weights cold as in the model (162 MB
    on the bench model: they do not stay in a 32 MiB L3 from one step to the next)."""
    gemms = ["torch", *packed_gemms()]
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    qkv = config.q_size + 2 * config.kv_size
    shapes = [("qkv", h, qkv), ("o", config.q_size, h), ("gate/up", h, i), ("down", i, h), ("lm head", h, v)]
    print(f"GEMMs, GFLOP/s, {' vs '.join(gemms)} (torch = F.linear; best of runs, weights hot):")
    for rows in (2048, 32):
        cells = []
        for name, k, n in shapes:
            if name == "lm head" and rows > 32:
                continue   # the LM head runs only on the rows that sample
            flop = 2 * rows * k * n / 1e9   # per second -> GFLOP/s
            rates = (flop / gemm_seconds(k, n, rows, gemm, repeat) for gemm in gemms)
            cells.append(f"{name} {' vs '.join(f'{r:.0f}' for r in rates)}")
        print(f"  {rows:5d} rows: " + "; ".join(cells))
    step = layer_matmuls(config) + [(h, v)]
    flop = sum(2 * 32 * k * n for k, n in step) / 1e9
    cells = []
    for gemm in gemms[1:]:
        linears = []
        for k, n in step:
            linear = Linear(k, n, bias=False)
            linear.pack(gemm)
            linears.append(linear)
        xs = {k: torch.randn(32, k) for k, _ in step}

        def run(linears=linears, xs=xs):
            for linear in linears:
                linear(xs[linear.in_features])

        with torch.inference_mode():
            ms = median_ms(run, repeat)
        cells.append(f"{gemm} {ms:.2f} ms ({flop / ms * 1e3:.0f} GFLOP/s)")
    print(f"  a decode step's {len(step)} matmuls at 32 rows, weights cold: " + "; ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--cpu-gemm", default="auto", help="the model's GEMM: auto | native | onednn | torch")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = default_tiny_path("bench")
    model, config = load_model(path, torch.float32, "cpu", args.cpu_gemm)
    print(f"model {path.name}: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"GEMM {model.lm_head.gemm}")
    bench_gemms(config, args.repeat)
    for backend_name in ("torch", "cpu"):
        bench_decode(model, config, args.repeat, backend_name)
    bench_prefill(model, config, path, max(3, args.repeat // 3))


if __name__ == "__main__":
    main()
