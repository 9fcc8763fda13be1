#!/usr/bin/env python
"""What streaming text costs per token: the incremental detokenizer decoding through
transformers' `decode` against the Rust `tokenizers` decode underneath it (what it uses where
the two give the same text), in one run.

    .venv/bin/python bench/detokenize.py              # bench and tiny-qwen2 tokenizers, 64 streams x 128 tokens

A stream decodes a short window twice per token (model_service/sampling/detokenizer.py); the
engine thread does it for every sequence of every step, so at 256 running sequences a
microsecond per token is a quarter of a millisecond of every step.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.model_service.prompt_tokens import load_tokenizer  # noqa: E402
from kvserve.model_service.sampling.detokenizer import IncrementalDetokenizer  # noqa: E402
from kvserve.model_service.tiny_model import default_tiny_path  # noqa: E402


class TransformersDecode:
    """The tokenizer with only transformers' `decode` in view: the detokenizer's other path."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


def per_token_us(tokenizer, streams: list[list[int]]) -> float:
    start = time.perf_counter()
    for ids in streams:
        detok = IncrementalDetokenizer(tokenizer, [5, 6, 7, 8, 9])
        for token in ids:
            detok.add([token])
    return 1e6 * (time.perf_counter() - start) / sum(map(len, streams))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["bench", "tiny-qwen2"])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the best of each is kept")
    args = ap.parse_args()
    print(f"{'tokenizer':<12} {'transformers decode':>20} {'tokenizers decode':>18} {'ratio':>6}")
    for preset in args.presets:
        tokenizer = load_tokenizer(default_tiny_path(preset))
        rng = random.Random(0)
        streams = [[rng.randrange(3, tokenizer.vocab_size) for _ in range(args.tokens)] for _ in range(args.streams)]
        slow, fast = [], []
        for _ in range(args.rounds):
            slow.append(per_token_us(TransformersDecode(tokenizer), streams))
            fast.append(per_token_us(tokenizer, streams))
        print(f"{preset:<12} {min(slow):>17.2f} us {min(fast):>15.2f} us {min(slow) / min(fast):>5.2f}x")


if __name__ == "__main__":
    main()
