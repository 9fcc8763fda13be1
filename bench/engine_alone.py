#!/usr/bin/env python
"""The throughput workload on kvserve's engine alone: no gRPC, no second process.

    .venv/bin/python bench/engine_alone.py                    # 32 requests, 256 new tokens
    .venv/bin/python bench/engine_alone.py --new-tokens 64 --json out.json
    .venv/bin/python bench/engine_alone.py --burn 5:29        # beside 5 ms of busy CPU every 29 ms
    .venv/bin/python bench/engine_alone.py --step-burst 2 --burst-in process

The model service's own build (`model_service.assembly.build`, in-process manager), its
engine thread, and the requests handed to `Engine.submit` directly, their events to a
callback. What kvserve up adds on top (the asyncio front end streaming every token over
gRPC, the manager in its own process, the client) is the gap between this and
bench/throughput.py's kvserve row; bench/throughput.py runs this script as its peer.

Run in a process of its own: it builds the model on a thread that ends, as the server does
(model_service.assembly.build_on_a_thread_that_ends), and no other thread may run torch first.

--burn BUSY:PERIOD runs a process beside the workload that keeps one core busy BUSY ms of
every PERIOD ms: about what kvserve up's front end, manager and client take per engine step.
It shows what any CPU taken from the forward's OpenMP threads costs on a small host.

--step-burst MS keeps a core busy MS ms after every pass of the engine loop, where the
servicer hands a step's events to its asyncio loop: the front end's streaming work, in a
thread of the engine's process that holds the GIL as the front end does (--burst-in thread),
or in a process of its own, as if the engine ran apart from the front end (process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import make_prompts  # noqa: E402
from kvserve.model_service.assembly import build_on_a_thread_that_ends  # noqa: E402
from kvserve.model_service.config import ModelServiceConfig  # noqa: E402
from kvserve.model_service.engine.events import Failed, Finished  # noqa: E402
from kvserve.model_service.engine.request import Request  # noqa: E402
from kvserve.model_service.sampling.params import SamplingParams  # noqa: E402
from kvserve.model_service.tiny_model import default_tiny_path  # noqa: E402


def run(engine, prompts: list[list[int]], new_tokens: int, tag: str) -> list[Finished]:
    finished: list[Finished] = []
    done = threading.Semaphore(0)

    def sink(event) -> None:
        if isinstance(event, (Finished, Failed)):
            finished.append(event)
            done.release()

    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        engine.submit(Request(f"{tag}-{i}", list(prompt), new_tokens, params), sink)
    for _ in prompts:
        done.acquire()
    failed = [e for e in finished if isinstance(e, Failed)]
    assert not failed, failed[0].message
    return finished


BURNER = """
import sys, time
busy, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(max(0.0, period - busy))
"""


def burner(spec: str | None) -> subprocess.Popen | None:
    if not spec:
        return None
    busy, period = spec.split(":")
    return subprocess.Popen([sys.executable, "-c", BURNER, busy, period])


STEP_BURNER = """
import os, sys, time
fd, busy = int(sys.argv[1]), float(sys.argv[2]) / 1e3
while os.read(fd, 4096):
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
"""


class StepBurst:
    """After every engine loop pass, once started, a core busy `ms` (see the module docstring).
    Its tick is the engine's on_step_end."""

    def __init__(self, ms: float | None, where: str) -> None:
        self.ms, self.where = ms, where
        self.write_fd: int | None = None
        self.proc: subprocess.Popen | None = None

    def tick(self) -> None:
        if self.write_fd is not None:
            os.write(self.write_fd, b"x")

    def start(self) -> None:
        if not self.ms:
            return
        read_fd, write_fd = os.pipe()
        if self.where == "process":
            self.proc = subprocess.Popen([sys.executable, "-c", STEP_BURNER, str(read_fd), str(self.ms)],
                                         pass_fds=(read_fd,))
        else:
            def spin() -> None:
                while os.read(read_fd, 4096):
                    start = time.perf_counter()
                    while time.perf_counter() - start < self.ms / 1e3:
                        pass
            threading.Thread(target=spin, daemon=True).start()
        self.write_fd = write_fd

    def stop(self) -> None:
        if self.write_fd is None:
            return
        write_fd, self.write_fd = self.write_fd, None
        os.close(write_fd)   # the burner reads end of file and ends
        if self.proc is not None:
            self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the generated bench model)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--attention-backend", default="auto", help="auto | torch | cpu (as the model service)")
    ap.add_argument("--cpu-gemm", default="auto", help="auto | native | onednn | torch (as the model service)")
    ap.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (as the model service)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | bfloat16 | ... (as the model service)")
    ap.add_argument("--burn", metavar="BUSY:PERIOD", default=None,
                    help="beside the run, keep one core busy BUSY ms of every PERIOD ms")
    ap.add_argument("--step-burst", metavar="MS", type=float, default=None,
                    help="after every engine loop pass, keep a core busy MS ms")
    ap.add_argument("--burst-in", choices=("thread", "process"), default="thread",
                    help="where --step-burst runs (default thread: in this process, holding the GIL)")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = ap.parse_args()

    path = Path(args.model) if args.model else default_tiny_path("bench")
    burst = StepBurst(args.step_burst, args.burst_in)
    stack = build_on_a_thread_that_ends(ModelServiceConfig(
        model=str(path), kvcache="inprocess", device="cpu", dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        attention_backend=args.attention_backend, cpu_gemm=args.cpu_gemm, kv_cache_dtype=args.kv_cache_dtype),
        on_step_end=burst.tick)
    engine = stack.engine
    engine.start()
    burn = None
    try:
        run(engine, [list(range(3, 35))], 4, "warm-up")   # as throughput.py: no workload prefix
        assert engine.wait_idle(60)
        prompts = make_prompts(args.requests, 32, 512, stack.model_config.vocab_size)
        burn = burner(args.burn)
        burst.start()
        before = dict(vars(engine.counters))
        start = time.perf_counter()
        finished = run(engine, prompts, args.new_tokens, "run")
        wall = time.perf_counter() - start
        after = vars(engine.counters)
    finally:
        burst.stop()
        engine.stop()
        if burn is not None:
            burn.kill()
    tokens = sum(f.completion_tokens for f in finished)
    assert tokens == args.requests * args.new_tokens, "a request stopped early"
    assert not any(f.cached_tokens for f in finished), "the workload hit the prefix cache"
    phases = {name: after[f"{name}_s"] - before[f"{name}_s"]
              for name in ("schedule", "manager", "copy", "forward", "sample", "emit")}
    result = {"tok_s": tokens / wall, "wall": wall, "steps": after["steps"] - before["steps"], "phases": phases}
    beside = f", beside {args.burn} ms of busy CPU" if args.burn else ""
    if args.step_burst:
        beside += f", {args.step_burst:g} ms busy after every step in a {args.burst_in}"
    print(f"engine alone{beside}, GEMM {args.cpu_gemm}, {args.requests} requests, {args.new_tokens} new tokens: {result['tok_s']:.1f} tok/s "
          f"({wall:.2f} s, {result['steps']} steps; forward {phases['forward']:.2f} s)")
    if args.json:
        args.json.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
