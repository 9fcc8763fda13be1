"""Every request at once through kvserve's gRPC API, each stream timed token by token
(bench/gpu_bench.py's kvserve part): throughput, the decode step as the clients see it (the
median gap between a stream's consecutive tokens), and where the engine's step time went."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

from bench.prompts import make_prompts
from bench.throughput import Stack, cpu_seconds, send_all
from kvserve.inference.v1 import inference_pb2 as pb


async def timed_stream(stub, prompt: list[int], new_tokens: int) -> tuple[pb.Finished, list[float]]:
    """One streamed request; its Finished and the arrival time of each message with tokens."""
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    finished, times = None, []
    async for r in stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)):
        if r.HasField("finished"):
            finished = r.finished
        elif r.HasField("chunk"):   # tokens (not prefill_done, not a queued place)
            times.append(time.perf_counter())
    return finished, times


def kvserve_run(stack: Stack, prompts: list[list[int]], new_tokens: int) -> dict:
    pids = stack.children()
    cpu = {name: -cpu_seconds(pid) for name, pid in pids.items()}
    before = stack.stub.GetServerStats(pb.GetServerStatsRequest())
    wall, results = asyncio.run(send_all(stack.address, prompts, new_tokens, timed_stream))
    after = stack.stub.GetServerStats(pb.GetServerStatsRequest())
    cpu = {name: cpu[name] + cpu_seconds(pid) for name, pid in pids.items()}
    finished = [f for f, _ in results]
    tokens = sum(f.usage.completion_tokens for f in finished)
    assert tokens == len(prompts) * new_tokens, "a request stopped early"
    assert not any(f.usage.cached_tokens for f in finished), "the workload hit the prefix cache"
    # gaps from the second token on: the first one may hold other prompts' prefill chunks
    gaps = [b - a for _, times in results for a, b in zip(times[1:], times[2:])]
    phases = {name: getattr(after, f"{name}_seconds") - getattr(before, f"{name}_seconds")
              for name in ("schedule", "manager", "copy", "forward", "sample", "emit")}
    steps = after.steps - before.steps
    step_s = sum(phases.values())
    return {"tok_s": tokens / wall, "wall": wall, "steps": steps,
            "decode_step_ms": 1e3 * statistics.median(gaps),
            "ttft_p50_ms": statistics.median(f.ttft_ms for f in finished),
            "step_ms": 1e3 * step_s / steps, "manager_share": phases["manager"] / step_s,
            "manager_ms": 1e3 * phases["manager"] / steps, "phases": phases,
            # CPU time per step of each process (all its threads): what the manager itself spends
            "cpu_ms_per_step": {name: 1e3 * seconds / steps for name, seconds in cpu.items()}}


def warm_up(stack: Stack, vocab: int) -> None:
    """A few requests of both shapes of step (prefill, decode), so that kernels compiled on first
    use (flash-attn 4's) stay out of the timed runs."""
    asyncio.run(send_all(stack.address, make_prompts(4, 100, 300, vocab, seed=99), 8, timed_stream))


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
