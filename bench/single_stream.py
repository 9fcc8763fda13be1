#!/usr/bin/env python
"""One request at a time: batch-1 decode speed of kvserve against transformers (and llama.cpp,
when given), beside the memory-bandwidth roofline measured in the same run.

    .venv/bin/python bench/single_stream.py                          # 32, 512, 2000-token prompts, f32 and bf16
    .venv/bin/python bench/single_stream.py --prompts 512 --dtypes float32 --new-tokens 64
    .venv/bin/python bench/single_stream.py --llama-bench /path/llama-bench --gguf-dir DIR   # + llama.cpp
    .venv/bin/python bench/single_stream.py --rounds 3 --skip-transformers --llama-bench ... # interleaved
    .venv/bin/python bench/single_stream.py --http --llama-server BIN --gguf-dir DIR          # both over HTTP

For each dtype and prompt length, one greedy request of --new-tokens tokens (EOS ignored):
  - kvserve's engine alone (in-process manager, no gRPC; a process of its own per dtype): time
    per output token from the engine's own events, p50 and p99, and where a step's time goes
    (the engine's phase timers, ms per step);
  - kvserve through gRPC (`kvserve up`, both services real processes; --skip-grpc leaves it out):
    the gaps between streamed tokens as the client receives them;
  - with --http, kvserve through its OpenAI HTTP front (`kvserve up --http-listen`), the same
    request streamed as server-sent events and read by the same client code as llama-server's
    below: the two servers over one protocol;
  - transformers `generate` on the same weights and dtype, one request, per-token times from a
    streamer;
  - llama.cpp's llama-bench where --llama-bench and --gguf-dir (bench-f32.gguf, bench-f16.gguf,
    converted from the same checkpoint) are given: decode tok/s at the prompt's depth (-d), the
    peer of the engine alone (no client, no server);
  - llama.cpp's server where --llama-server and --gguf-dir are given: the same request streamed
    over HTTP (a message per token) to `llama-server`, the gaps as its client receives them, the
    peer of kvserve through gRPC (a server and a client on the same cores);
  - with --rounds N, every run above but transformers N times, round after round, the table
    giving each figure's median over the rounds and the ratio to llama.cpp of each round (this
    machine's speed drifts by more than the differences measured);
  - the roofline: a decode step reads every linear weight once (the embedding's one row aside)
    and the context's K and V, so its least time is those bytes over the memory bandwidth
    measured here (a 256 MiB sum on every thread, best of several, before and after the runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.throughput import Stack, free_port, make_prompts, memory_bandwidth, request  # noqa: E402
from kvserve.model_service.tiny_model import default_tiny_path  # noqa: E402

PHASES = ("schedule", "manager", "copy", "forward", "sample", "emit")


def summary(gaps_ms: list[float]) -> dict:
    gaps = sorted(gaps_ms)
    return {"p50": statistics.median(gaps), "p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
            "tok_s": 1e3 * len(gaps) / sum(gaps)}


def step_bytes(cfg, dtype_bytes: int, context: int) -> float:
    """Bytes a batch-1 decode step must read: every linear weight and the K/V of `context` tokens."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    weights = cfg.num_layers * layer + h * cfg.vocab_size
    return dtype_bytes * (weights + 2 * cfg.num_layers * kv * context)


# ------------------------------------------------------------------------------ engine alone

def greedy_token_times(engine, prompt: list[int], n: int, tag: str) -> list[float]:
    """One greedy request of n tokens (EOS ignored) through a started engine: when each token
    event arrived (perf_counter)."""
    from kvserve.model_service.engine.events import Failed, Finished, Tokens
    from kvserve.model_service.engine.request import Request
    from kvserve.model_service.sampling.params import SamplingParams

    times: list[float] = []
    done = threading.Event()

    def sink(event) -> None:
        if isinstance(event, Tokens):
            times.append(time.perf_counter())
        elif isinstance(event, (Finished, Failed)):
            assert isinstance(event, Finished), event
            done.set()

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    engine.submit(Request(tag, list(prompt), n, params), sink)
    done.wait()
    return times


def engine_child(model: str, dtype: str, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """In this process: the model service's own build, one request at a time."""
    from kvserve.model_service.assembly import build_on_a_thread_that_ends
    from kvserve.model_service.config import ModelServiceConfig

    stack = build_on_a_thread_that_ends(ModelServiceConfig(model=model, kvcache="inprocess", device="cpu",
                                                           dtype=dtype))
    engine = stack.engine
    engine.start()

    out = []
    try:
        greedy_token_times(engine, list(range(3, 40)), 8, "warm-up")
        for i, prompt in enumerate(prompts):
            before = dict(vars(engine.counters))
            start = time.perf_counter()
            times = greedy_token_times(engine, prompt, new_tokens, f"run-{i}")
            after = vars(engine.counters)
            steps = after["steps"] - before["steps"]
            out.append({**summary([(b - a) * 1e3 for a, b in zip(times, times[1:])]),
                        "ttft_ms": (times[0] - start) * 1e3, "gemm": stack.gemm, "backend": stack.backend_name,
                        "phases": {p: 1e3 * (after[f"{p}_s"] - before[f"{p}_s"]) / steps for p in PHASES}})
    finally:
        engine.stop()
    return out


def engine_alone(model: Path, dtype: str, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"model": str(model), "dtype": dtype, "prompts": prompts, "new": new_tokens}))
        subprocess.run([sys.executable, __file__, "--child", str(spec), str(out)], cwd=ROOT, check=True)
        return json.loads(out.read_text())


# ------------------------------------------------------------------------------------ gRPC

def through_grpc(model: Path, dtype: str, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    stack = Stack(model, ["--dtype", dtype])
    try:
        for _ in stack.stub.Generate(request(list(range(3, 40)), 8)):   # warm-up
            pass
        out = []
        for prompt in prompts:
            start, times = time.perf_counter(), []
            for r in stack.stub.Generate(request(prompt, new_tokens)):
                if r.HasField("chunk"):
                    times += [time.perf_counter()] * len(r.chunk.token_ids)
            out.append({**summary([(b - a) * 1e3 for a, b in zip(times, times[1:])]),
                        "ttft_ms": (times[0] - start) * 1e3})
        return out
    finally:
        stack.close()


def sse_token_times(url: str, body: dict) -> list[float]:
    """When each streamed event with text arrived (perf_counter), an event a token: the client
    code llama-server's stream is read with (bench/llama_cpp_peer.py), on kvserve's HTTP front."""
    import urllib.request
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    times: list[float] = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("text"):
                    times.append(time.perf_counter())
    return times


def through_http(model: Path, dtype: str, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    http = f"127.0.0.1:{free_port()}"
    stack = Stack(model, ["--dtype", dtype, "--http-listen", http])
    url = f"http://{http}/v1/completions"

    def body(prompt: list[int], n: int) -> dict:
        return {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        sse_token_times(url, body(list(range(3, 40)), 8))   # warm-up
        out = []
        for prompt in prompts:
            start = time.perf_counter()
            times = sse_token_times(url, body(prompt, new_tokens))
            out.append({**summary([(b - a) * 1e3 for a, b in zip(times, times[1:])]),
                        "ttft_ms": (times[0] - start) * 1e3})
        return out
    finally:
        stack.close()


# ----------------------------------------------------------------------------- transformers

def transformers_runs(model: Path, dtype: str, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    out = []
    with torch.inference_mode():
        hf.generate(torch.tensor([list(range(3, 40))]), max_new_tokens=4, **kwargs)   # warm-up
        for prompt in prompts:
            clock = Clock()
            start = time.perf_counter()
            hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                        streamer=clock, **kwargs)
            times = clock.times[1:]   # the first put() is the prompt
            out.append({**summary([(b - a) * 1e3 for a, b in zip(times, times[1:])]),
                        "ttft_ms": (times[0] - start) * 1e3})
    return out


# -------------------------------------------------------------------------------- llama.cpp

def llama_cpp_server(binary: str, gguf: Path, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """One streamed request at a time to llama-server (one slot, every core)."""
    from bench.llama_cpp_peer import LlamaServer

    server = LlamaServer(binary, gguf, 1, max(map(len, prompts)) + new_tokens + 16)
    try:
        server.stream(list(range(3, 40)), 8)   # warm-up
        out = []
        for prompt in prompts:
            start = time.perf_counter()
            times = server.stream(prompt, new_tokens)
            out.append({**summary([(b - a) * 1e3 for a, b in zip(times, times[1:])]),
                        "ttft_ms": (times[0] - start) * 1e3})
        return out
    finally:
        server.close()


def llama_cpp(binary: str, gguf: Path, depths: list[int], new_tokens: int) -> dict[int, float]:
    """Decode tok/s at each depth (llama-bench -n new_tokens -d depth), on every core."""
    import os
    cmd = [binary, "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-d", ",".join(map(str, depths)),
           "-t", str(os.cpu_count()), "-r", "3", "-o", "json"]
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return {row["n_depth"]: row["avg_ts"] for row in rows}


# ------------------------------------------------------------------------------------- main

def median_run(runs: list[dict]) -> dict:
    """One prompt's runs over the rounds -> the median of each figure (the first run's phases)."""
    out = dict(runs[0])
    for key in ("p50", "p99", "tok_s", "ttft_ms"):
        out[key] = statistics.median(r[key] for r in runs)
    return out


def print_round_ratios(rounds: dict, dtypes: list[str], prompts: list[int]) -> None:
    """Time per token of llama.cpp over kvserve's, round by round: the engine alone against
    llama-bench, kvserve through gRPC and through HTTP against llama-server (against llama-bench
    without it)."""
    print("\nllama.cpp's time per token / kvserve's, round by round (above 1: kvserve faster):")
    for dtype in dtypes:
        bench_runs = next((runs for (d, how), runs in rounds.items()
                           if d == dtype and how.startswith("llama.cpp") and "server" not in how), None)
        server_runs = next((runs for (d, how), runs in rounds.items() if d == dtype and "llama.cpp server" in how),
                           None)
        for how, peer, against in (("engine alone", bench_runs, "llama-bench"),
                                   ("gRPC", server_runs or bench_runs, "llama-server" if server_runs else "llama-bench"),
                                   ("HTTP", server_runs or bench_runs, "llama-server" if server_runs else "llama-bench")):
            for i, n in enumerate(prompts):
                if peer is not None and (dtype, how) in rounds:
                    ratios = [p[i]["p50"] / k[i]["p50"] for p, k in zip(peer, rounds[dtype, how])]
                    print(f"  {dtype}, prompt {n}, {how} against {against}: " + ", ".join(f"{r:.2f}" for r in ratios)
                          + f"   median {statistics.median(ratios):.2f}")


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        spec = json.loads(Path(sys.argv[2]).read_text())
        Path(sys.argv[3]).write_text(json.dumps(engine_child(spec["model"], spec["dtype"], spec["prompts"], spec["new"])))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the generated bench model)")
    ap.add_argument("--prompts", type=int, nargs="+", default=[32, 512, 2000], help="prompt lengths")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--skip-grpc", action="store_true")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--http", action="store_true", help="also kvserve through its OpenAI HTTP front")
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (with --gguf-dir)")
    ap.add_argument("--gguf-dir", type=Path, default=None, help="bench-f32.gguf and bench-f16.gguf of the same weights")
    ap.add_argument("--rounds", type=int, default=1, help="run everything but transformers this many times, "
                                                           "interleaved, and report medians")
    args = ap.parse_args()

    from kvserve.model_service.model.config import ModelConfig

    model = Path(args.model) if args.model else default_tiny_path("bench")
    cfg = ModelConfig.from_pretrained(model)
    prompts = [make_prompts(1, n, n, cfg.vocab_size, seed=n)[0] for n in args.prompts]
    bw = memory_bandwidth()
    print(f"model {model.name}: hidden {cfg.hidden_size}, {cfg.num_layers} layers, vocab {cfg.vocab_size}; "
          f"memory bandwidth {bw / 1e9:.1f} GB/s; {args.new_tokens} new tokens per request", flush=True)
    rounds: dict[tuple[str, str], list[list[dict]]] = {}   # (dtype, run) -> per round, per prompt
    for round_ in range(args.rounds):
        for dtype in args.dtypes:
            rounds.setdefault((dtype, "engine alone"), []).append(engine_alone(model, dtype, prompts, args.new_tokens))
            if not args.skip_grpc:
                rounds.setdefault((dtype, "gRPC"), []).append(through_grpc(model, dtype, prompts, args.new_tokens))
            if args.http:
                rounds.setdefault((dtype, "HTTP"), []).append(through_http(model, dtype, prompts, args.new_tokens))
            if not args.skip_transformers and round_ == 0:
                rounds[dtype, "transformers"] = [transformers_runs(model, dtype, prompts, args.new_tokens)]
            if args.llama_bench and args.gguf_dir:
                name = {"float32": "f32", "bfloat16": "f16"}[dtype]
                rates = llama_cpp(args.llama_bench, args.gguf_dir / f"bench-{name}.gguf", args.prompts,
                                  args.new_tokens)
                rounds.setdefault((dtype, f"llama.cpp {name}"), []).append(
                    [{"tok_s": rates[n], "p50": 1e3 / rates[n], "p99": float("nan"), "ttft_ms": float("nan")}
                     for n in args.prompts])
            if args.llama_server and args.gguf_dir:
                name = {"float32": "f32", "bfloat16": "f16"}[dtype]
                rounds.setdefault((dtype, f"llama.cpp server {name}"), []).append(llama_cpp_server(
                    args.llama_server, args.gguf_dir / f"bench-{name}.gguf", prompts, args.new_tokens))
    results = {key: [median_run([runs[i] for runs in per_round]) for i in range(len(args.prompts))]
               for key, per_round in rounds.items()}
    if args.rounds > 1:
        print_round_ratios(rounds, args.dtypes, args.prompts)
    bw = max(bw, memory_bandwidth())

    print("\n| dtype | prompt | run | ms/token p50 | p99 | decode tok/s | TTFT ms | roofline ms/token | % of roofline | vs transformers |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (dtype, how), runs in results.items():
        size = 4 if dtype == "float32" else 2
        for n, r in zip(args.prompts, runs):
            roof = 1e3 * step_bytes(cfg, size, n + args.new_tokens // 2) / bw
            hf = results.get((dtype, "transformers"))
            vs = f"{hf[args.prompts.index(n)]['p50'] / r['p50']:.2f}x" if hf else "n/a"
            print(f"| {dtype} | {n} | {how} | {r['p50']:.2f} | {r['p99']:.2f} | {r['tok_s']:.1f} | "
                  f"{r['ttft_ms']:.0f} | {roof:.2f} | {100 * roof / r['p50']:.0f}% | {vs} |")
    print("\nwhere an engine-alone step's time goes (ms per step):")
    for (dtype, how), runs in results.items():
        if how == "engine alone":
            for n, r in zip(args.prompts, runs):
                print(f"  {dtype}, prompt {n} ({r['gemm']} GEMM, {r['backend']} attention): "
                      + ", ".join(f"{p} {v:.2f}" for p, v in r["phases"].items()))


if __name__ == "__main__":
    main()
