#!/usr/bin/env python
"""Speculative decoding by prompt lookup against decoding without it, on two workloads, in one run.

    .venv/bin/python bench/speculative.py                   # bench model, K = 4, 6 prompts each
    .venv/bin/python bench/speculative.py --draft 8 --new-tokens 128 --rounds 3

Two model services' engines side by side in this process (--speculative off and ngram), each
with its KV-cache manager in a process of its own over a Unix socket (the deployed layout, so a
step that cannot be pipelined pays the real round trip). One request at a time, greedy, EOS
ignored: what speculation is for is a single stream's latency.

Workloads, each the same prompts for both engines:
- repeating: outputs that repeat spans of what came before. A model with random weights has no
  induction heads, so such prompts are found rather than written: among prompts of one token
  repeated (the bench model often falls into a short loop after them), those whose greedy
  continuation, generated here first without speculation, a lookup of its earlier tokens predicts
  best over the whole generation.
- random: random token prompts, whose continuations never repeat (drafts rarely found, rarely right).

Per workload and engine: time per output token (p50 over requests of (e2e - TTFT) / (tokens - 1)),
output tok/s over the whole workload, and for ngram the acceptance rate (accepted / drafted
tokens) and the mean tokens a draft step gives (1 + accepted per draft). Rounds alternate the
order of the two engines; greedy tokens are checked equal.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
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
from kvserve.model_service.engine.speculation import NGRAM_MAX, NGRAM_MIN  # noqa: E402
from kvserve.model_service.sampling.params import SamplingParams  # noqa: E402
from kvserve.model_service.tiny_model import default_tiny_path  # noqa: E402

NUM_PAGES, PAGE_SIZE = 1024, 16


def start_manager(socket: str) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("kvserve")
    return subprocess.Popen([str(exe), "kvcache", "--listen", f"unix://{socket}", "--num-pages", str(NUM_PAGES),
                             "--page-size", str(PAGE_SIZE), "--log-level", "warning"])


def generate(engine, prompt: list[int], new_tokens: int, tag: str) -> tuple[list[int], Finished]:
    tokens: list[int] = []
    out: list = []
    done = threading.Event()

    def sink(event) -> None:
        if isinstance(event, Tokens):
            tokens.extend(event.token_ids)
        elif isinstance(event, (Finished, Failed)):
            out.append(event)
            done.set()

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.submit(Request(tag, list(prompt), new_tokens, params), sink)
    done.wait()
    assert isinstance(out[0], Finished), out[0]
    return tokens, out[0]


def predictability(prompt: list[int], output: list[int]) -> float:
    """Share of output tokens a first-match lookup of the last NGRAM_MAX..NGRAM_MIN tokens predicts."""
    seq, right = list(prompt), 0
    for token in output:
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            suffix = seq[-n:]
            at = next((i for i in range(len(seq) - n) if seq[i:i + n] == suffix), None)
            if at is not None:
                right += seq[at + n] == token
                break
        seq.append(token)
    return right / len(output)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the generated bench model)")
    ap.add_argument("--draft", type=int, default=4, help="--num-draft-tokens")
    ap.add_argument("--prompts", type=int, default=6, help="requests per workload")
    ap.add_argument("--candidates", type=int, default=16, help="repeated-token prompts the repeating workload is chosen from")
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    path = Path(args.model) if args.model else default_tiny_path("bench")
    tmp = tempfile.mkdtemp(prefix="kvserve-spec-")
    managers, engines = [], {}
    try:
        for mode in ("off", "ngram"):
            socket = os.path.join(tmp, f"{mode}.sock")
            managers.append(start_manager(socket))
            stack = build_on_a_thread_that_ends(ModelServiceConfig(
                model=str(path), kvcache=f"unix://{socket}", device="cpu", num_pages=NUM_PAGES,
                page_size=PAGE_SIZE, speculative=mode, num_draft_tokens=args.draft))
            stack.engine.start(timeout_s=60)
            engines[mode] = stack.engine
        vocab = stack.model_config.vocab_size
        rng = random.Random(0)
        for engine in engines.values():
            generate(engine, [5, 6, 7, 8], 4, "warm")

        scored = []
        for i in range(args.candidates):
            prompt = [rng.randrange(3, vocab)] * args.prompt_tokens
            out, _ = generate(engines["off"], prompt, args.new_tokens, f"pick{i}")
            scored.append((predictability(prompt, out), prompt))
        scored.sort(key=lambda s: -s[0])
        workloads = {
            "repeating": [p for _, p in scored[:args.prompts]],
            "random": [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)],
        }
        print(f"model {path.name}, K = {args.draft}, {args.prompts} requests per workload one at a time, "
              f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, greedy; repeating prompts chosen "
              f"from {args.candidates} (a lookup predicts {statistics.mean(s for s, _ in scored[:args.prompts]):.0%} "
              f"of their output, the rest {statistics.mean(s for s, _ in scored[args.prompts:]):.0%})")
        print(f"{'workload':>10} {'engine':>7} {'ms/token p50':>13} {'tok/s':>8} {'accept':>7} {'tok/draft':>9} "
              f"{'tok/step':>8} {'vs off':>7}")
        for name, prompts in workloads.items():
            per = {m: {"tpot": [], "tokens": 0, "seconds": 0.0} for m in engines}
            spec = {"drafts": 0, "draft": 0, "accepted": 0}
            steps = {m: 0 for m in engines}
            outputs: dict[str, list] = {m: [] for m in engines}
            for k in range(args.rounds):
                for mode in (("off", "ngram") if k % 2 == 0 else ("ngram", "off")):
                    engine = engines[mode]
                    before = dict(vars(engine.counters))
                    for j, prompt in enumerate(prompts):
                        start = time.perf_counter()
                        tokens, f = generate(engine, prompt, args.new_tokens, f"{name}{k}-{j}")
                        per[mode]["seconds"] += time.perf_counter() - start
                        per[mode]["tokens"] += len(tokens)
                        per[mode]["tpot"].append((f.total_ms - f.ttft_ms) / (len(tokens) - 1))
                        if k == 0:
                            outputs[mode].append(tokens)
                    after = vars(engine.counters)
                    steps[mode] += after["steps"] - before["steps"]
                    if mode == "ngram":
                        spec["drafts"] += after["spec_drafts"] - before["spec_drafts"]
                        spec["draft"] += after["spec_draft_tokens"] - before["spec_draft_tokens"]
                        spec["accepted"] += after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            assert outputs["off"] == outputs["ngram"], f"{name}: speculation changed greedy tokens"
            base = statistics.median(per["off"]["tpot"])
            for mode in engines:
                tpot = statistics.median(per[mode]["tpot"])
                rate = per[mode]["tokens"] / per[mode]["seconds"]
                if mode == "ngram":
                    accept = f"{spec['accepted'] / max(1, spec['draft']):.0%}"
                    per_draft = f"{1 + spec['accepted'] / max(1, spec['drafts']):.2f}"
                else:
                    accept = per_draft = "-"
                per_step = per[mode]["tokens"] / max(1, steps[mode])
                print(f"{name:>10} {mode:>7} {tpot:>13.2f} {rate:>8.1f} {accept:>7} {per_draft:>9} {per_step:>8.2f} "
                      f"{tpot / base:>7.2f}")
    finally:
        for engine in engines.values():
            engine.stop()
        for m in managers:
            m.terminate()
            m.wait(10)


if __name__ == "__main__":
    main()
