#!/usr/bin/env python
"""What a structured output costs the engine: requests held to a format against the same requests
in free text, on the engine alone (in-process manager), in one run.

    .venv/bin/python bench/structured_output.py                  # bench model, 1 and 32 requests
    .venv/bin/python bench/structured_output.py --model tiny --batches 1 8

The formats: a regex of --new-tokens lowercase letters and spaces, and a JSON Schema of one free
string field; every request greedy, EOS ignored, --new-tokens at most. Printed: the time of a
decode step (each request's time from its first token to its last over its tokens after the
first, from its own Finished, the median over the batch; best of --rounds), and its ratio to
free text's. The difference is the matcher's mask each step
(llguidance's fill of the allowed tokens, then applying it to the logits row) and the sampler's
slow path it forces.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.model_service.prompt_tokens import resolve_model_path  # noqa: E402
from kvserve.model_service.sampling.structured import Format  # noqa: E402
from tests.engine.harness import EngineHarness, wait  # noqa: E402


def run(h: EngineHarness, prompts: list[list[int]], new_tokens: int, fmt: Format | None) -> float:
    """Seconds per decode step: each request's time from its first token to its last over its
    tokens after the first (its own Finished timings), the median over the batch."""
    extra = {} if fmt is None else {"format": fmt}
    outcomes = [h.submit(p, new_tokens, **extra) for p in prompts]
    wait(outcomes)
    steps = [(o.finished.total_ms - o.finished.ttft_ms) / 1e3 / (o.finished.completion_tokens - 1)
             for o in outcomes if o.finished.completion_tokens > 1]
    return statistics.median(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(0)
    h = EngineHarness(resolve_model_path(args.model), max_num_seqs=max(args.batches))
    vocab = h.stack.model_config.vocab_size
    formats = {
        "free text": None,
        "regex": Format("regex", f"[a-z ]{{{args.new_tokens}}}"),
        "json schema": Format("json_schema", json.dumps({"type": "object", "properties": {"s": {"type": "string"}},
                                                         "required": ["s"]})),
    }
    print(f"model {args.model} (vocabulary {vocab}); {args.new_tokens} new tokens at most; best of {args.rounds}")
    try:
        for batch in args.batches:
            prompts = [[rng.randrange(3, min(vocab, 30000)) for _ in range(32)] for _ in range(batch)]
            best: dict[str, float] = {}
            for _ in range(args.rounds):   # interleaved, so that the machine's drift falls on all
                for name, fmt in formats.items():
                    best[name] = min(best.get(name, float("inf")), run(h, prompts, args.new_tokens, fmt))
            base = best["free text"]
            print(f"  {batch:>3} requests: " + ", ".join(
                f"{name} {ms * 1e3:.2f} ms/step ({ms / base:.2f}x)" for name, ms in best.items()))
    finally:
        h.close()


if __name__ == "__main__":
    main()
