"""Every request at once through kvserve's gRPC API (bench/gpu_bench.py's kvserve part):
bench/throughput.py's run, and from it the manager's share of the engine's step and each
process's CPU per step."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterator
from pathlib import Path

from bench.prompts import make_prompts
from bench.throughput import Stack, run_kvserve, send_all
from kvserve.inference.v1 import inference_pb2 as pb


def kvserve_run(stack: Stack, prompts: list[list[int]], new_tokens: int) -> dict:
    r = run_kvserve(stack, prompts, new_tokens)
    phases, steps = r["phases"], r["steps"]
    step_s = sum(phases.values())
    return {"tok_s": r["tok_s"], "wall": r["wall"], "steps": steps, "decode_step_ms": r["decode_step_ms"],
            "ttft_p50_ms": statistics.median(r["ttft_ms"]),
            "step_ms": 1e3 * step_s / steps, "manager_share": phases["manager"] / step_s,
            "manager_ms": 1e3 * phases["manager"] / steps, "phases": phases,
            # CPU time per step of each process (all its threads): what the manager itself spends
            "cpu_ms_per_step": {name: 1e3 * seconds / steps for name, seconds in r["cpu"].items()}}


def warm_up(stack: Stack, vocab: int) -> None:
    """A few requests of both shapes of step (prefill, decode), so that kernels compiled on first
    use (flash-attn 4's) stay out of the timed runs."""
    asyncio.run(send_all(stack.address, make_prompts(4, 100, 300, vocab, seed=99), 8))


def run_stack(model: Path, server_args: list[str], workloads: dict[int, list[list[int]]], new_tokens: int,
              vocab: int) -> Iterator[tuple[int, dict]]:
    """`kvserve up` on `model`, warmed up, then each workload in turn: (concurrency, result) as each
    finishes."""
    stack = Stack(model, server_args)
    try:
        info = stack.stub.GetModelInfo(pb.GetModelInfoRequest())
        warm_up(stack, vocab)
        for c, prompts in workloads.items():
            result = kvserve_run(stack, prompts, new_tokens)
            result["server"] = {"page_size": info.page_size, "num_pages": info.num_pages}
            yield c, result
    finally:
        stack.close()
