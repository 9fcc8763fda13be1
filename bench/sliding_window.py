#!/usr/bin/env python
"""A sliding-window model against the same weights with full attention, one long stream each.

    .venv/bin/python bench/sliding_window.py                     # bench weights, window 256, 2,000 tokens
    .venv/bin/python bench/sliding_window.py --window 512 --new-tokens 3000
    .venv/bin/python bench/sliding_window.py --beside 60000     # one step's time beside a long stream

The bench model's weights are served three ways, each on the engine alone (the model service's
build, in-process manager), one request of a 64-token prompt and --new-tokens greedy tokens:
- full: as generated (Llama, full attention);
- window: the same files declared a Mistral with `sliding_window` = --window (the two share
  their weight names), so attention sees the last W tokens and pages past them go back;
- window + sinks: the same with --attention-sink 4.
Per run: time per output token over four spans of the stream, and the most KV pages the
sequence held at once (read from the manager before every step).

--beside N: what one long stream costs the short ones it is batched with. The window + sinks
model's runner (no manager: the step's work is made up, the pages' contents do not matter to the
time) runs decode steps of 48 rows of 200-700 tokens, alone and beside one row N tokens long
whose page table names every page it ever had, as an attention-sink stream's does; then that
row's last 2,048 tokens as one prefill chunk (its recompute after a preemption).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.model_service.assembly import build_on_a_thread_that_ends  # noqa: E402
from kvserve.model_service.config import ModelServiceConfig  # noqa: E402
from kvserve.model_service.engine.events import Failed, Finished, Tokens  # noqa: E402
from kvserve.model_service.engine.request import Request  # noqa: E402
from kvserve.model_service.sampling.params import SamplingParams  # noqa: E402
from kvserve.model_service.tiny_model import default_tiny_path  # noqa: E402


def as_mistral(src: Path, dst: Path, window: int) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def run(path: Path, prompt: list[int], new_tokens: int, sinks: int) -> tuple[list[float], int, int]:
    stack = build_on_a_thread_that_ends(ModelServiceConfig(model=str(path), kvcache="inprocess", device="cpu",
                                                           attention_sink=sinks))
    engine, state = stack.engine, stack.kv.manager.state
    peak = [0]
    inner = engine.runner.execute

    def execute(work):
        for w in work:
            seq = state.seqs.get(w.request.seq_id)
            if seq is not None:
                peak[0] = max(peak[0], len(seq.held()))
        return inner(work)

    engine.runner.execute = execute
    stamps: list[float] = []
    done = threading.Event()

    def sink(event) -> None:
        if isinstance(event, Tokens):
            stamps.extend([time.perf_counter()] * len(event.token_ids))
        elif isinstance(event, (Finished, Failed)):
            done.set()

    engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        engine.submit(Request("long", list(prompt), new_tokens, params), sink)
        done.wait()
    finally:
        engine.stop()
    spans = []
    quarter = new_tokens // 4
    for k in range(4):
        a, b = max(1, k * quarter), (k + 1) * quarter - 1
        spans.append((stamps[b] - stamps[a]) / (b - a) * 1e3)
    return spans, peak[0], stack.page_size


class _Held:
    """What the runner reads of a request: its tokens and page table."""

    def __init__(self, length: int, pages: int, page_size: int, first: int) -> None:
        self.tokens = [7] * length
        self.page_table = [(first + i) % pages for i in range(-(-length // page_size))]


def beside(path: Path, long_len: int, steps: int) -> None:
    from kvserve.model_service.engine.scheduler import Work

    stack = build_on_a_thread_that_ends(ModelServiceConfig(model=str(path), kvcache="inprocess", device="cpu",
                                                           attention_sink=4))
    runner, ps = stack.engine.runner, stack.page_size
    pages = stack.num_pages
    short = [_Held(200 + 10 * i, pages, ps, 50 * i) for i in range(48)]
    rows = {"48 short rows": short, f"+ one of {long_len:,}": [_Held(long_len, pages, ps, 7)] + short}
    for name, held in rows.items():
        work = [Work(h, len(h.tokens) - 1, 1) for h in held]
        runner.execute(work)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            runner.execute(work)
            times.append(time.perf_counter() - t)
        times.sort()
        print(f"{name:>22}: a step {times[len(times) // 2] * 1e3:8.2f} ms (median of {steps})")
    # The long row's last 2,048 tokens as one prefill chunk: its recompute after a preemption.
    work = [Work(rows[f"+ one of {long_len:,}"][0], long_len - 2048, 2048)]
    times = []
    for _ in range(max(3, steps // 4)):
        t = time.perf_counter()
        runner.execute(work)
        times.append(time.perf_counter() - t)
    times.sort()
    print(f"{'a chunk of 2,048 at its end':>22}: {times[len(times) // 2] * 1e3:8.2f} ms (median of {len(times)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=2000)
    ap.add_argument("--beside", type=int, default=0, metavar="N")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    base = default_tiny_path("bench")
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-window-"))
    try:
        windowed = as_mistral(base, tmp / "window", args.window)
        if args.beside:
            print(f"bench weights, window {args.window}, 4 sinks, page size 16")
            beside(windowed, args.beside, args.steps)
            return
        prompt = list(range(100, 164))
        quarter = args.new_tokens // 4
        print(f"bench weights, page size 16, 64-token prompt, {args.new_tokens} greedy tokens, window {args.window}")
        print(f"{'':>16} " + " ".join(f"{'ms/tok ' + str(k * quarter) + '-' + str((k + 1) * quarter):>16}"
                                      for k in range(4)) + f" {'peak pages':>11}")
        for name, path, sinks in (("full", base, 0), ("window", windowed, 0), ("window + sinks", windowed, 4)):
            spans, peak, _ = run(path, prompt, args.new_tokens, sinks)
            print(f"{name:>16} " + " ".join(f"{s:>16.2f}" for s in spans) + f" {peak:>11}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
