#!/usr/bin/env python
"""A checkpoint that has learned something, made here: a preset's shape trained for a few hundred
steps on a synthetic language, so that its greedy choices are as decisive as a trained model's,
where random weights' are near-ties everywhere (docs/benchmarks.md, the GPU section).

    python bench/trained_model.py --preset bench --out /tmp/bench-trained --device cuda          # ~300 steps
    .venv/bin/python bench/trained_model.py --preset tiny --out /tmp/t --steps 20 --device cpu   # a smoke run

The language: a fixed random Markov chain over the first `--tokens` ids after the special ones,
each id followed by one of two successors, 85 % / 15 %. The model is trained with transformers
(its Llama class: the same architecture), saved with save_pretrained beside the preset's
tokenizer, and `chain.json` keeps the chain so that prompts in its language can be drawn again
(`prompts()`). No weights leave the machine; nothing is fetched.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.model_service.tiny_model import make_preset  # noqa: E402

FIRST_ID = 3   # ids below are the tiny tokenizer's special tokens


class Chain:
    """Each id in [FIRST_ID, FIRST_ID + tokens) is followed by one of two successors."""

    def __init__(self, tokens: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        ids = range(FIRST_ID, FIRST_ID + tokens)
        self.tokens, self.seed = tokens, seed
        self.successors = {i: rng.sample(ids, 2) for i in ids}

    def walk(self, length: int, rng: random.Random) -> list[int]:
        token = rng.randrange(FIRST_ID, FIRST_ID + self.tokens)
        out = [token]
        for _ in range(length - 1):
            first, second = self.successors[token]
            token = first if rng.random() < 0.85 else second
            out.append(token)
        return out

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "seed": self.seed}


def prompts(path: Path, n: int, lo: int, hi: int, seed: int = 7) -> list[list[int]]:
    """n prompts of lo..hi tokens in the language the checkpoint at `path` was trained on."""
    spec = json.loads((path / "chain.json").read_text())
    chain, rng = Chain(spec["tokens"], spec["seed"]), random.Random(seed)
    return [chain.walk(rng.randrange(lo, hi + 1), rng) for _ in range(n)]


def train(preset: str, out: Path, steps: int, tokens: int, batch: int, length: int, device: str,
          lr: float = 1e-3, seed: int = 0) -> dict:
    """Writes the trained checkpoint to `out`; returns the first and last losses and the time."""
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    start_dir = make_preset(out / "untrained", preset)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(start_dir, dtype=torch.float32).to(device).train()
    chain, rng = Chain(tokens, seed), random.Random(seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        ids = torch.tensor([chain.walk(length, rng) for _ in range(batch)], device=device)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval().save_pretrained(out)   # safetensors
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(start_dir / name, out / name)
    shutil.rmtree(start_dir)
    (out / "chain.json").write_text(json.dumps(chain.to_json()))
    return {"first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:]),
            "seconds": time.perf_counter() - start, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=512, help="ids the language uses")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    result = train(args.preset, args.out, args.steps, args.tokens, args.batch, args.length, args.device)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
