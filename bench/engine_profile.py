"""Where the model service's time goes under the throughput workload, sampled with py-spy.

    .venv/bin/pip install py-spy                      # a profiler, not a dependency of kvserve
    .venv/bin/python bench/engine_profile.py          # 32 requests, 256 new tokens (~1 min)
    .venv/bin/python bench/engine_profile.py --new-tokens 64 --raw /tmp/spy.txt

Starts `kvserve up` on the bench model, sends bench/throughput.py's workload, and samples the
model service process with py-spy while it runs (200 Hz, every thread). Prints the engine
thread's samples by phase, and the other threads' counts (the asyncio loop streaming the calls,
gRPC's pollers). py-spy samples without stopping the process, so a thread waiting for the GIL
is counted in the frame that waits for it.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import ROOT, Stack, make_prompts, run_kvserve  # noqa: E402

# First match wins, tested against the engine thread's whole stack (file paths included).
PHASES = [
    ("forward: GEMMs (model/linear.py)", "model/linear.py"),
    ("forward: attention page gather", "PageGather.__call__"),
    ("forward: attention kernels (SDPA, matmuls, cache write)", "model_service/attention/"),
    ("forward: batch build (runner.build)", "ModelRunner.build"),
    ("forward: the rest (norms, rope, embedding)", "ModelRunner.execute"),
    ("sampling", "model_service/sampling/"),
    ("manager round trip", "contract/client.py"),
    ("scheduling", "engine/scheduler.py"),
    ("streaming out (events to the asyncio loop)", "Engine._emit"),
    ("streaming out (events to the asyncio loop)", "event_relay.py"),
]


def model_service_pid(stack: Stack) -> int:
    pid = stack.children().get("model service")
    if pid is None:
        raise RuntimeError("no model service process under `kvserve up`")
    return pid


def read_raw(path: Path) -> list[tuple[str, list[str], int]]:
    """py-spy's raw format: 'thread (id): name;frame;frame;... count' per line."""
    samples = []
    for line in path.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        thread, *frames = stack.split(";")
        samples.append((thread.split(": ", 1)[-1], frames, int(count)))
    return samples


def phase_of(frames: list[str]) -> str:
    joined = ";".join(frames)
    for name, marker in PHASES:
        if marker in joined:
            return name
    return "engine: other (" + frames[-1].split(" (")[0] + ")"


def summarize(samples: list[tuple[str, list[str], int]]) -> None:
    threads = collections.Counter()
    phases = collections.Counter()
    for thread, frames, count in samples:
        threads[thread] += count
        if thread == "kvserve-engine":
            phases[phase_of(frames)] += count
    engine = threads["kvserve-engine"]
    print(f"engine thread: {engine} samples (200 Hz)")
    for name, count in phases.most_common():
        print(f"  {100 * count / engine:5.1f} %  {name}")
    print("other threads (samples):", ", ".join(f"{t} {c}" for t, c in threads.most_common() if t != "kvserve-engine"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--raw", type=Path, default=None, help="keep py-spy's raw samples here")
    args = ap.parse_args()
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        sys.exit("py-spy is not installed: .venv/bin/pip install py-spy")

    from kvserve.model_service.model.config import ModelConfig
    from kvserve.model_service.tiny_model import default_tiny_path

    path = default_tiny_path("bench")
    prompts = make_prompts(args.requests, 32, 512, ModelConfig.from_pretrained(path).vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        raw = args.raw or Path(tmp) / "spy.txt"
        stack = Stack(path, ["--max-num-seqs", str(max(64, args.requests))])
        try:
            recorder = subprocess.Popen([spy, "record", "--pid", str(model_service_pid(stack)), "--rate", "200",
                                         "--format", "raw", "--threads", "--nonblocking", "--output", str(raw)],
                                        cwd=ROOT, stdout=subprocess.DEVNULL)
            time.sleep(1.0)  # py-spy attaches
            result = run_kvserve(stack, prompts, args.new_tokens)
            recorder.send_signal(signal.SIGINT)
            recorder.wait(60)
        finally:
            stack.close()
        print(f"{args.requests} requests, {args.new_tokens} new tokens: {result['tok_s']:.1f} tok/s "
              f"under py-spy, {result['steps']} steps")
        summarize(read_raw(raw))


if __name__ == "__main__":
    main()
