#!/usr/bin/env python
"""bfloat16 on CPU (weights, or KV pages under float32 weights) against transformers: tokens, logits.

    .venv/bin/python bench/bf16_agreement.py                 # 32 prompts, 64 new tokens
    .venv/bin/python bench/bf16_agreement.py --prompts 8 --new-tokens 16
    .venv/bin/python bench/bf16_agreement.py --trained 60   # the bench shape trained first (minutes)
    .venv/bin/python bench/bf16_agreement.py --dtype float32 --kv-cache-dtype bfloat16 --trained 40

Tokens, teacher-forced: transformers' `generate` gives each prompt (32-512 random tokens) its
greedy continuation in bfloat16; then, for every position j of it, kvserve's engine (in-process
manager, its CPU defaults: the small-batch linear, native RMSNorm and RoPE; the prefix cache on,
so each request computes its last few tokens as decoding does) is asked for one greedy token after
the prompt and the first j tokens of that continuation. Agreement is the share of positions where
its token is transformers'. Beside it, the same count for transformers in float32 on the same
sequences: how often bfloat16's own rounding flips a greedy choice on this model (random weights
give flat distributions with many near-ties); and transformers in bfloat16 against itself, the
whole sequence in one forward where `generate` went a token at a time: how often a change of
shape alone (the same ops, other blockings of the same sums) flips one. Free-running figures (each side continuing from its
own tokens) come last: after a first difference the two continue from different text.

Logits: the prompt's last position, kvserve's model against transformers', in bfloat16; beside it
transformers in bfloat16 against transformers in float32, the scale bfloat16 rounding alone
explains.

`--dtype float32 --kv-cache-dtype bfloat16`: the other bfloat16 kvserve offers, float32 weights
over bfloat16 KV pages, against transformers in float32 (the reference then; transformers in
bfloat16 the scale of what rounding everything to bfloat16 would do).

`--trained STEPS`: the same shape trained that many steps on a synthetic language first
(bench/trained_model.py; kept under `--trained-dir`), with prompts drawn in that language. A
trained model's greedy choices are decisive where random weights' are near-ties, so this is the
agreement a real checkpoint would see; random weights measure mostly how often rounding breaks a
tie.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.throughput import make_prompts  # noqa: E402
from kvserve.model_service.tiny_model import default_tiny_path  # noqa: E402


def kvserve_tokens(model: Path, prompts: list[list[int]], new_tokens: int,
                   prefix_caching: bool = False, small_linear: str = "auto", gemm: str = "auto",
                   attention: str = "auto", dtype: str = "bfloat16", kv_cache_dtype: str = "auto") -> list[list[int]]:
    from kvserve.model_service.assembly import build_on_a_thread_that_ends
    from kvserve.model_service.config import ModelServiceConfig
    from kvserve.model_service.engine.events import Failed, Finished, Tokens
    from kvserve.model_service.engine.request import Request
    from kvserve.model_service.sampling.params import SamplingParams

    stack = build_on_a_thread_that_ends(ModelServiceConfig(model=str(model), kvcache="inprocess", device="cpu",
                                                           dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                                           prefix_caching=prefix_caching,
                                                           cpu_small_linear=small_linear, cpu_gemm=gemm,
                                                           attention_backend=attention))
    engine = stack.engine
    engine.start()
    outputs = [[] for _ in prompts]
    done = threading.Semaphore(0)
    try:
        for i, prompt in enumerate(prompts):   # one at a time: a later one hits what an earlier cached
            if prefix_caching and i:
                done.acquire()
            def sink(event, out=outputs[i]) -> None:
                if isinstance(event, Tokens):
                    out.extend(event.token_ids)
                elif isinstance(event, (Finished, Failed)):
                    assert isinstance(event, Finished), event
                    done.release()
            params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
            engine.submit(Request(f"p{i}", list(prompt), new_tokens, params), sink)
        for _ in prompts if not prefix_caching else prompts[:1]:
            done.acquire()
    finally:
        engine.stop()
    return outputs


def prefill_logits(model, config, prompt: list[int], dtype, kv_dtype):
    """The model alone over one prompt in one chunk, on pages of its own (of kv_dtype): its last logits."""
    import torch

    from kvserve.model_service.attention.select import select_backend
    from kvserve.model_service.engine.request import Request
    from kvserve.model_service.engine.runner import ModelRunner
    from kvserve.model_service.engine.scheduler import Work
    from kvserve.model_service.kv_cache import KVCache

    page_size, cpu = 16, torch.device("cpu")
    pages = -(-len(prompt) // page_size)
    cache = KVCache(config, pages, page_size, kv_dtype, cpu)
    backend = select_backend("torch", cpu, page_size, dtype)
    request = Request("logits", list(prompt), 1)
    request.page_table = list(range(pages))
    return ModelRunner(model, backend, cache, page_size, cpu).execute([Work(request, 0, len(prompt))])[0].float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the generated bench model)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--cpu-small-linear", default="auto", help="as the model service's flag (auto | off)")
    ap.add_argument("--cpu-gemm", default="auto", help="as the model service's flag")
    ap.add_argument("--attention-backend", default="auto", help="as the model service's flag")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="kvserve's and the reference transformers' (the other is the rounding scale)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="as the model service's flag")
    ap.add_argument("--trained", type=int, default=0, metavar="STEPS",
                    help="train the bench shape this many steps on a synthetic language first, prompts in it")
    ap.add_argument("--trained-dir", type=Path, default=Path.home() / ".cache" / "kvserve" / "trained",
                    help="where --trained keeps its checkpoints (one per step count)")
    args = ap.parse_args()

    model = Path(args.model) if args.model else default_tiny_path("bench")
    if args.trained:
        from bench.trained_model import prompts as chain_prompts, train

        model = args.trained_dir / f"bench-{args.trained}"
        if not (model / "chain.json").is_file():
            print("training:", train("bench", model, args.trained, 512, 32, 256, "cpu"), flush=True)
        prompts = chain_prompts(model, args.prompts, 32, 512)
    else:
        from kvserve.model_service.model.config import ModelConfig
        vocab = ModelConfig.from_pretrained(model).vocab_size
        prompts = make_prompts(args.prompts, 32, 512, vocab, seed=7)
    print(f"model {model}", flush=True)
    flags = dict(small_linear=args.cpu_small_linear, gemm=args.cpu_gemm, attention=args.attention_backend,
                 dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    other = "float32" if args.dtype == "bfloat16" else "bfloat16"
    ours = kvserve_tokens(model, prompts, args.new_tokens, **flags)

    import torch
    from transformers import AutoModelForCausalLM

    from kvserve.model_service.model.loader import load_model

    # ref: transformers in kvserve's dtype, the reference; alt: in the other, the rounding scale
    ref = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, args.dtype)).eval()
    alt = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, other)).eval()
    theirs = []
    with torch.inference_mode():
        for prompt in prompts:
            theirs.append(ref.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens,
                                        min_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                                        pad_token_id=0)[0, len(prompt):].tolist())
    asks = [prompt + out[:j] for prompt, out in zip(prompts, theirs) for j in range(args.new_tokens)]
    forced = [t[0] for t in kvserve_tokens(model, asks, 1, prefix_caching=True, **flags)]
    want = [t for out in theirs for t in out]
    agree = sum(a == b for a, b in zip(forced, want))
    alt_agree = whole_agree = 0
    with torch.inference_mode():
        for prompt, out in zip(prompts, theirs):
            logits = alt(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
            alt_agree += sum(int(a == b) for a, b in zip(logits.argmax(-1).tolist(), out))
            # transformers against itself: the same model over the whole sequence in one
            # forward, where generate computed the continuation one token at a time
            logits = ref(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
            whole_agree += sum(int(a == b) for a, b in zip(logits.argmax(-1).tolist(), out))
    ours_name = args.dtype + ("" if args.kv_cache_dtype in ("auto", args.dtype) else f", {args.kv_cache_dtype} pages")
    print(f"{args.prompts} prompts x {args.new_tokens} positions, teacher-forced on transformers' {args.dtype} "
          f"greedy tokens: kvserve {ours_name} agrees on {100 * agree / len(want):.2f} %; transformers {other} "
          f"on {100 * alt_agree / len(want):.2f} %; transformers {args.dtype} itself, the whole sequence in one "
          f"forward, on {100 * whole_agree / len(want):.2f} %")

    agree = total = identical = 0
    firsts = []
    for out, mine in zip(theirs, ours):
        same = [a == b for a, b in zip(out, mine)]
        agree, total = agree + sum(same), total + len(same)
        identical += all(same)
        if not all(same):
            firsts.append(same.index(False))
    print(f"free-running: {100 * agree / total:.2f} % of positions agree; {identical} sequences identical; "
          f"the others first differ at {sorted(firsts) if firsts else '-'}")

    from kvserve.model_service.dtype_choice import pick_kv_cache_dtype

    dtype = getattr(torch, args.dtype)
    ours_model, config = load_model(model, args.dtype)
    kv_dtype = pick_kv_cache_dtype(args.kv_cache_dtype, dtype, torch.device("cpu"))
    diff = scale = 0.0
    with torch.inference_mode():
        for prompt in prompts:
            want = ref(torch.tensor([prompt])).logits[0, -1].float()
            other_logits = alt(torch.tensor([prompt])).logits[0, -1].float()
            got = prefill_logits(ours_model, config, prompt, dtype, kv_dtype)
            diff = max(diff, (got - want).abs().max().item())
            scale = max(scale, (want - other_logits).abs().max().item())
    print(f"last-position logits, max |kvserve {ours_name} - transformers {args.dtype}| {diff:.4f}; "
          f"max |transformers bfloat16 - transformers float32| {scale:.4f} (bfloat16's own rounding)")


if __name__ == "__main__":
    main()
