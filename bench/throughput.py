"""End-to-end throughput of kvserve against transformers on the same model, in one run.

    .venv/bin/python bench/throughput.py                # the issue's workload (several minutes)
    .venv/bin/python bench/throughput.py --quick        # 8 requests, 16 tokens: a smoke run

Workload: the `bench` model (Llama, hidden 512, 8 layers, 8 heads / 2 KV heads,
intermediate 1536, vocab 32000, float32, seed 0), 32 requests sent at once,
prompts of 32-512 random tokens, greedy, EOS ignored, 64 then 256 new tokens.
Printed side by side:
  - kvserve through gRPC (`kvserve up`: both services as real processes), streaming every
    token (--stream-interval 1, the default) and in chunks of 4 (fewer messages: on 2 cores
    each one's gRPC work in server and client takes CPU from the forward),
  - kvserve's engine alone (bench/engine_alone.py: no gRPC, manager in-process), the
    peer that shows what the stack around the engine costs,
  - transformers `generate` on one static left-padded batch,
  - transformers `generate_batch` (its continuous batching),
  - the roofline: the workload's matmul FLOPs (weights and attention) over the GEMM FLOP/s
    measured here (the best of measurements before, between and after the runs), at each
    GEMM's rate (F.linear, oneDNN packed, native); and the honest one the goal is read
    against (roofline_seconds): per phase the larger of FLOPs over the best GEMM rate and the
    bytes it must read (weights, K and V) over the memory bandwidth measured in the same run,
  - multi-turn conversations (8 turns, +64 tokens each): time to first token
    per turn with the prefix cache on and off (median of 15 conversations),
  - where the engine's step time goes (its phase timers, via GetServerStats),
  - with --llama-server BIN --gguf PATH: llama.cpp's server on the same prompts at once, one
    slot per request (bench/llama_cpp_peer.py), and kvserve's output tok/s against it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.inference.v1 import inference_pb2 as pb  # noqa: E402
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402
from kvserve.model_service.tiny_model import default_tiny_path  # noqa: E402
from bench.llama_cpp_peer import run_llama_server  # noqa: E402
from bench.model_size import matmul_params  # noqa: E402
from bench.prompts import make_prompts  # noqa: E402
from bench.throughput_report import (  # noqa: E402
    ALONE, HONEST, print_comparison, print_goals, print_steps, print_throughput, print_turns)


# ----------------------------------------------------------------------------- workload

def weight_flops(cfg, prompts: list[list[int]], new_tokens: int) -> float:
    """2 x weights x tokens: every prompt token through the layers, one LM-head row per
    sequence at the end of its prefill, then (new_tokens - 1) decode tokens through all."""
    layer, head = matmul_params(cfg)
    layers = cfg.num_layers * layer
    n = len(prompts)
    prefill = sum(map(len, prompts)) * layers + n * head
    decode = n * (new_tokens - 1) * (layers + head)
    return 2.0 * (prefill + decode)


def attention_flops(cfg, prompts: list[list[int]], new_tokens: int) -> float:
    """The attention matmuls, Q K^T and P V: 2 x head_dim FLOPs each per query head, layer and
    (query, key) pair a causal model must compute. A prompt of L tokens has L(L+1)/2 pairs;
    its k-th decode token (k = 1 .. new_tokens - 1) attends L + k keys."""
    per_pair = 2 * 2 * cfg.head_dim * cfg.num_heads * cfg.num_layers
    pairs = sum(n * (n + 1) // 2 + (new_tokens - 1) * n + new_tokens * (new_tokens - 1) // 2
                for n in map(len, prompts))
    return float(per_pair * pairs)


def matmul_flops(cfg, prompts: list[list[int]], new_tokens: int) -> float:
    """The workload's matmul FLOPs: the weight matmuls and the attention matmuls."""
    return weight_flops(cfg, prompts, new_tokens) + attention_flops(cfg, prompts, new_tokens)


def memory_bandwidth(reps: int = 7) -> float:
    """Bytes/s streamed from memory that no cache holds (a decode step's weights), on every torch
    thread, the best of `reps`: the larger of a sum over 256 MiB and kvserve's own one-row matvec
    over a 256 MiB weight (kernels/small_linear.c), both on huge pages as the model service keeps
    what it streams (host_memory.py). The roofline is the best this machine was seen to do."""
    from kvserve.model_service.host_memory import huge_page_zeros
    from kvserve.model_service.kernels import small_linear

    a = huge_page_zeros((64 * 2**20,), torch.float32).fill_(1.0)
    runs = [a.sum]
    try:
        matvec = small_linear.load().bind(a.view(-1, 1024))
        x = torch.ones(1, 1024)
        runs.append(lambda: matvec(x))
    except small_linear.KernelUnavailable:
        pass
    best = float("inf")
    for _ in range(reps):
        for run in runs:
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
    return a.numel() * 4 / best


def roofline_seconds(cfg, prompts: list[list[int]], new_tokens: int, rate: float, bandwidth: float,
                     dtype_bytes: int = 4, kv_bytes: int | None = None) -> tuple[float, float]:
    """The least time the workload can take, (prefill, decode): each phase the larger of its
    matmul FLOPs over the best GEMM rate and the bytes it must read over the memory bandwidth.
    Prefill: every prompt token through every weight (compute-bound). Decode: step k (k = 1 ..
    new_tokens - 1) gives every sequence its k-th token, reading every linear weight once and
    every sequence's K and V so far (kv_bytes an element: dtype_bytes unless the cache is narrower)."""
    kv = cfg.num_kv_heads * cfg.head_dim
    layer, head = matmul_params(cfg)
    weights = cfg.num_layers * layer + head
    per_pair = 2 * 2 * cfg.head_dim * cfg.num_heads * cfg.num_layers
    lengths = [len(p) for p in prompts]
    prefill_flops = 2.0 * (sum(lengths) * cfg.num_layers * layer + len(prompts) * head) \
        + per_pair * sum(n * (n + 1) // 2 for n in lengths)
    prefill = max(prefill_flops / rate, dtype_bytes * weights / bandwidth)
    decode = 0.0
    for k in range(1, new_tokens):
        context = sum(lengths) + len(lengths) * k
        flops = 2.0 * weights * len(lengths) + per_pair * context
        bytes_read = dtype_bytes * weights + (kv_bytes or dtype_bytes) * 2 * cfg.num_layers * kv * context
        decode += max(flops / rate, bytes_read / bandwidth)
    return prefill, decode


def gemm_rates(cfg, rows: int = 2048, reps: int = 7) -> dict[str, float]:
    """FLOP/s of the model's own layer GEMMs at prefill size, measured now, on this machine, for
    torch's F.linear (MKL on x86) and for the packed GEMMs the model service runs on CPU (oneDNN,
    native). Each shape counts its fastest of `reps` calls: a roofline is the best the machine does."""
    from bench.model_bench import gemm_seconds, packed_gemms

    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]
    flops = sum(2.0 * rows * k * n for k, n in shapes)
    names = {"torch": "F.linear", "onednn": "oneDNN", "native": "native"}
    return {names[gemm]: flops / sum(gemm_seconds(k, n, rows, gemm, reps) for k, n in shapes)
            for gemm in ["torch", *packed_gemms()]}


def best_rates(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Per GEMM, the faster of two measurements: the roofline is the best the machine did."""
    return {name: max(a[name], b[name]) for name in a}


# ------------------------------------------------------------------------------ kvserve

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """`kvserve up` as a subprocess, ready once both health services answer."""

    def __init__(self, model: Path, extra: list[str]) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="kvserve-bench-")
        self.address = f"127.0.0.1:{free_port()}"
        self.kv_address = f"unix://{self.tmp.name}/kv.sock"
        cmd = [sys.executable, "-m", "kvserve.services.cli.main", "--log-level", "warning", "up", "--model", str(model),
               "--listen", self.address, "--kvcache-listen", self.kv_address, *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.InferenceStub(self.channel)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve up exited with {self.proc.returncode}")
            try:
                self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=2)
                return
            except grpc.RpcError:
                time.sleep(0.5)
        raise RuntimeError("kvserve up did not become ready")

    def children(self) -> dict[str, int]:
        """The pids of `kvserve up`'s two processes: {"model service": pid, "manager": pid}."""
        pids = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        out = {}
        for pid in pids:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            out["model service" if b"model" in argv else "manager"] = int(pid)
        return out

    def close(self) -> None:
        self.channel.close()
        self.proc.terminate()
        self.proc.wait(60)
        self.tmp.cleanup()


def request(prompt: list[int], new_tokens: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


async def generate(stub, prompt: list[int], new_tokens: int) -> tuple[pb.Finished, list[float]]:
    """One streamed request through a grpc.aio stub; its Finished message and when each message
    with tokens arrived (not prefill_done)."""
    finished, times = None, []
    async for r in stub.Generate(request(prompt, new_tokens)):
        if r.HasField("finished"):
            finished = r.finished
        elif r.HasField("chunk"):
            times.append(time.perf_counter())
    return finished, times


async def send_all(address: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    """Every prompt at once from one asyncio client, timed until the last stream ends; each
    stream's (Finished, token arrival times). On 2 cores the client shares the server's CPU: one
    loop costs less of it than a sync-gRPC thread per stream (docs/benchmarks.md)."""
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = pb_grpc.InferenceStub(channel)
        start = time.perf_counter()
        results = await asyncio.gather(*(generate(stub, p, new_tokens) for p in prompts))
        return time.perf_counter() - start, results


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time of a process (Linux /proc), or of this one."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_kvserve(stack: Stack, prompts: list[list[int]], new_tokens: int) -> dict:
    for _ in stack.stub.Generate(request(list(range(3, 35)), 4)):  # warm-up; no workload prefix
        pass
    before = stack.stub.GetServerStats(pb.GetServerStatsRequest())
    pids = {**stack.children(), "client": None}
    cpu = {name: -cpu_seconds(pid) for name, pid in pids.items()}
    wall, results = asyncio.run(send_all(stack.address, prompts, new_tokens))
    cpu = {name: cpu[name] + cpu_seconds(pid) for name, pid in pids.items()}
    after = stack.stub.GetServerStats(pb.GetServerStatsRequest())
    finished = [f for f, _ in results]
    tokens = sum(f.usage.completion_tokens for f in finished)
    assert tokens == len(prompts) * new_tokens, "a request stopped early"
    # transformers prefills every prompt; a prefix hit would skip work it does.
    assert not any(f.usage.cached_tokens for f in finished), "the workload hit the prefix cache"
    phases = {name: getattr(after, f"{name}_seconds") - getattr(before, f"{name}_seconds")
              for name in ("schedule", "manager", "copy", "forward", "sample", "emit")}
    steps = after.steps - before.steps
    # a stream's gaps from its second token on: the first may hold other prompts' prefill chunks
    gaps = [b - a for _, times in results for a, b in zip(times[1:], times[2:])]
    return {"tok_s": tokens / wall, "wall": wall, "steps": steps, "phases": phases, "cpu": cpu,
            "ttft_ms": sorted(f.ttft_ms for f in finished),
            "decode_step_ms": 1e3 * statistics.median(gaps) if gaps else float("nan")}


def engine_alone(model: Path, requests: int, new_tokens: int, extra: list[str] = ()) -> dict:
    """bench/engine_alone.py in a process of its own (it must be the first to run torch there);
    extra: its options, as a variant's (--cpu-gemm X, --kv-cache-dtype X)."""
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        out = Path(tmp) / "alone.json"
        subprocess.run([sys.executable, str(ROOT / "bench" / "engine_alone.py"), "--model", str(model),
                        "--requests", str(requests), "--new-tokens", str(new_tokens),
                        "--max-num-seqs", str(max(64, requests)), "--json", str(out), *extra],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


# -------------------------------------------------------------------------- transformers

def hf_static(model, prompts: list[list[int]], new_tokens: int) -> dict:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding, as batched generation needs
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:2, -16:], attention_mask=mask[:2, -16:], max_new_tokens=2, do_sample=False,
                       eos_token_id=None, pad_token_id=0)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        wall = time.perf_counter() - start
    assert out.shape[1] == width + new_tokens
    return {"tok_s": len(prompts) * new_tokens / wall, "wall": wall}


def hf_batch(model, prompts: list[list[int]], new_tokens: int) -> dict:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    try:  # no inference_mode: generate_batch updates its tensors in place from its own thread
        start = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        wall = time.perf_counter() - start
    except Exception as exc:  # an API that moves between releases: report, don't crash the run
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    tokens = sum(len(o.generated_tokens) for o in out.values())
    if tokens != len(prompts) * new_tokens:
        return {"error": f"generated {tokens} of {len(prompts) * new_tokens} tokens"}
    return {"tok_s": tokens / wall, "wall": wall}


# ------------------------------------------------------------------------------ multi-turn

def multi_turn(stack: Stack, vocab: int, turns: int, add: int, reply: int, seed: int = 1) -> list[float]:
    """Server-side time to first token of each turn of one growing conversation."""
    rng = random.Random(seed)
    history: list[int] = []
    ttfts = []
    for _ in range(turns):
        history += [rng.randrange(3, vocab) for _ in range(add)]
        out: dict = {}
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=reply, ignore_eos=True)
        tokens = []
        for r in stack.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=history), sampling=sampling)):
            if r.HasField("chunk"):
                tokens += r.chunk.token_ids
            if r.HasField("finished"):
                out = r.finished
        ttfts.append(out.ttft_ms)
        history += tokens
    return ttfts


def multi_turn_median(stack: Stack, vocab: int, turns: int, conversations: int) -> list[float]:
    """Per turn, the median over `conversations` independent conversations (no shared tokens):
    one short time to first token moves a lot when anything else wakes on 2 cores, and the
    turn-8 / turn-1 ratio of medians of 5 wandered far more than that of medians of 15
    (docs/benchmarks.md)."""
    runs = [multi_turn(stack, vocab, turns, 64, 16, seed=1 + c) for c in range(conversations)]
    return [statistics.median(turn) for turn in zip(*runs)]


# ------------------------------------------------------------------------------------ main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the generated bench model)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--quick", action="store_true", help="8 requests, 16 new tokens, 3 turns")
    ap.add_argument("--skip-hf-batch", action="store_true", help="skip transformers' generate_batch (slow)")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=15, help="multi-turn: median of this many")
    ap.add_argument("--stream-intervals", type=int, nargs="+", default=[1, 4],
                    help="kvserve --stream-interval values to run (default 1, the server's default, and 4)")
    ap.add_argument("--skip-engine-alone", action="store_true", help="skip the engine-alone peer run")
    ap.add_argument("--cpu-gemms", nargs="+", default=None, metavar="GEMM",
                    help="run kvserve with each of these --cpu-gemm values, interleaved, and compare them")
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=None, metavar="DTYPE",
                    help="run kvserve and the engine alone with each of these --kv-cache-dtype values, "
                         "interleaved, and compare them")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --cpu-gemms or --kv-cache-dtypes: this many runs of each, the order "
                         "alternating round by round")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `kvserve up` argument (repeatable)")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary: run it as a peer")
    ap.add_argument("--gguf", type=Path, default=None, help="with --llama-server: a GGUF of the same weights")
    args = ap.parse_args()
    if args.cpu_gemms and args.kv_cache_dtypes:
        ap.error("compare GEMMs or KV cache dtypes, not both at once")
    if args.quick:
        args.requests, args.new_tokens, args.turns, args.conversations = 8, [16], 3, 2

    from transformers import AutoModelForCausalLM

    from kvserve.model_service.model.config import ModelConfig

    path = Path(args.model) if args.model else default_tiny_path("bench")
    cfg = ModelConfig.from_pretrained(path)
    prompts = make_prompts(args.requests, 32, 512, cfg.vocab_size)
    print(f"model {path.name}: {cfg.architecture}, hidden {cfg.hidden_size}, {cfg.num_layers} layers; "
          f"{args.requests} requests, {sum(map(len, prompts))} prompt tokens; torch threads {torch.get_num_threads()}")

    for n in args.new_tokens:
        w, a = weight_flops(cfg, prompts, n), attention_flops(cfg, prompts, n)
        print(f"matmul FLOPs at {n} new tokens: {(w + a) / 1e9:.1f} G (weights {w / 1e9:.1f}, "
              f"attention {a / 1e9:.1f})")
    rates = gemm_rates(cfg)
    bandwidth = memory_bandwidth()
    print(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s")
    print("GEMM rate on the model's layer shapes, 2048 rows: "
          + ", ".join(f"{name} {r / 1e9:.1f} GFLOP/s" for name, r in rates.items()))
    server = ["--max-num-seqs", str(max(64, args.requests)), *args.server_arg]
    # (label, options) of each variant compared: "GEMM native", ["--cpu-gemm", "native"]; or one, plain
    variants = ([(f"GEMM {g}", ["--cpu-gemm", g]) for g in args.cpu_gemms or ()]
                + [(f"KV {d}", ["--kv-cache-dtype", d]) for d in args.kv_cache_dtypes or ()]) or [("", [])]
    results: dict[tuple[int, str], list[dict]] = {}
    peers: dict[int, dict] = {}   # new tokens -> llama.cpp's run
    for n in args.new_tokens:
        for round_ in range(args.rounds if len(variants) > 1 else 1):
            for label, extra in variants if round_ % 2 == 0 else variants[::-1]:
                for interval in args.stream_intervals:  # a fresh stack each: a last run's prompts would be hits
                    how = f"gRPC, interval {interval}" + (f", {label}" if label else "")
                    stack = Stack(path, server + ["--stream-interval", str(interval)] + extra)
                    try:
                        results.setdefault((n, how), []).append(run_kvserve(stack, prompts, n))
                    finally:
                        stack.close()
                if not args.skip_engine_alone:
                    how = ALONE + (f", {label}" if label else "")
                    results.setdefault((n, how), []).append(engine_alone(path, args.requests, n, extra))
        if args.llama_server and args.gguf:
            peers[n] = run_llama_server(args.llama_server, args.gguf, prompts, n)
            print(f"llama.cpp server, {n} new tokens: {peers[n]['tok_s']:.1f} tok/s", flush=True)
    if len(variants) > 1:
        print_comparison(results, [label for label, _ in variants])
    rows = []
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for n in args.new_tokens:
        static = hf_static(hf, prompts, n)
        batch = {"error": "skipped"} if args.skip_hf_batch else hf_batch(hf, prompts, n)
        rows += [(n, how, sorted(runs, key=lambda k: k["tok_s"])[len(runs) // 2], static, batch)
                 for (m, how), runs in results.items() if m == n]   # the median run of each
        rates = best_rates(rates, gemm_rates(cfg))  # re-measured: the machine's speed drifts

    turns = {}
    for caching in (True, False):
        stack = Stack(path, server + ([] if caching else ["--no-prefix-caching"]))
        try:
            multi_turn(stack, cfg.vocab_size, 2, 16, 4, seed=99)  # warm-up
            turns[caching] = multi_turn_median(stack, cfg.vocab_size, args.turns, args.conversations)
        finally:
            stack.close()

    rates = best_rates(rates, gemm_rates(cfg))
    bandwidth = max(bandwidth, memory_bandwidth())
    print("best GEMM rate of the run: " + ", ".join(f"{name} {r / 1e9:.1f} GFLOP/s" for name, r in rates.items())
          + f"; best memory bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows = [(n, how, k, static, batch, {**{name: args.requests * n / (matmul_flops(cfg, prompts, n) / r)
                                           for name, r in rates.items()},
                                        HONEST: args.requests * n / sum(roofline_seconds(
                                            cfg, prompts, n, max(rates.values()), bandwidth,
                                            kv_bytes=2 if how.endswith("KV bfloat16") else 4))})
            for n, how, k, static, batch in rows]
    print_throughput(rows)
    print_steps(rows)
    print_turns(turns, args.turns, args.conversations)
    print_goals(rows, turns, peers)


if __name__ == "__main__":
    main()
