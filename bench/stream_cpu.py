#!/usr/bin/env python
"""Where the CPU goes while one greedy stream runs through `kvserve up`: CPU time of every thread
of the model service and the manager, and of this client, over a window of the stream.

    .venv/bin/python bench/stream_cpu.py                       # the bench model, float32
    .venv/bin/python bench/stream_cpu.py --dtype bfloat16 --seconds 5

On a machine whose cores the forward's threads fill, every other thread's CPU is taken from the
forward: this says how much each part of the stack (front end, manager, client) takes per token.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.throughput import Stack, request  # noqa: E402
from kvserve.inference.v1 import inference_pb2 as pb  # noqa: E402
from kvserve.model_service.tiny_model import default_tiny_path  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[tuple[str, str], float]:
    """(thread id, name) -> CPU seconds (user + system) so far, from /proc."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue   # the thread ended
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[tid, name] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the generated bench model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seconds", type=float, default=5.0, help="the window measured, inside the stream")
    args = ap.parse_args()

    stack = Stack(Path(args.model) if args.model else default_tiny_path("bench"), ["--dtype", args.dtype])
    try:
        for _ in stack.stub.Generate(request(list(range(3, 40)), 8)):   # warm-up
            pass
        times: list[float] = []

        prompt = list(range(3, 35))
        call = stack.stub.Generate(request(prompt, stack.stub.GetModelInfo(pb.GetModelInfoRequest()).max_model_len
                                           - len(prompt)))

        def stream() -> None:
            for r in call:
                if r.HasField("chunk"):
                    times.extend([time.perf_counter()] * len(r.chunk.token_ids))
                if times and times[-1] - times[0] > args.seconds + 2:
                    call.cancel()
                    return

        worker = threading.Thread(target=stream, daemon=True)
        worker.start()
        time.sleep(1.0)
        pids = stack.children()
        before = {part: thread_cpu(pid) for part, pid in pids.items()}
        mine, start = os.times(), time.perf_counter()
        first = len(times)
        time.sleep(args.seconds)
        after = {part: thread_cpu(pid) for part, pid in pids.items()}
        mine_after, tokens = os.times(), len(times) - first
        window = time.perf_counter() - start
        worker.join()
    finally:
        stack.close()
    print(f"{tokens} tokens in {window:.1f} s ({1e3 * window / tokens:.2f} ms a token); CPU ms per token:")
    for part in pids:
        rows = sorted(((after[part][k] - before[part].get(k, 0.0), k) for k in after[part]), reverse=True)
        total = sum(d for d, _ in rows)
        print(f"  {part}: {1e3 * total / tokens:.2f}")
        for spent, (tid, name) in rows:
            if spent > 0:
                print(f"    thread {tid} {name}: {1e3 * spent / tokens:.2f}")
    client = mine_after.user + mine_after.system - mine.user - mine.system
    print(f"  this client: {1e3 * client / tokens:.2f}")


if __name__ == "__main__":
    main()
