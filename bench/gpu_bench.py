#!/usr/bin/env python
"""kvserve on a CUDA GPU: the flash_attn backend against the torch backend in bfloat16, and
throughput through gRPC against transformers `generate` on the same GPU and model.

    python bench/gpu_bench.py                                # every part (a GPU with ~40 GB free)
    python bench/gpu_bench.py --parts hf --json r.json       # one part; results merge into --json
    python bench/gpu_bench.py --report --json r.json         # the table of what --json holds
    python bench/gpu_bench.py --quick --device cpu           # the logic on CPU: tiny model, small runs, backend auto

Parts (results merge into one JSON file, so parts may run as separate invocations on one machine):

- bandwidth: a 2 GiB device-to-device copy, bytes read plus bytes written over its best time: the
  rate the decode roofline is read against.
- agreement: the `bench` model in bfloat16 (weights and pages), 32 prompts of 128-1024 random
  tokens and 64 decode steps, batched by the engine's own ModelRunner. Every step feeds the torch
  backend's greedy tokens to every run (teacher forcing: at each position both backends see the
  same context, so one early difference cannot spoil the rest). Per position: whether the
  flash_attn backend's greedy token is the torch backend's, and their largest |logit difference|.
  Beside it, the same model in float32 (torch backend) against the bfloat16 one: how far bfloat16
  rounding alone moves these logits, the scale the flash_attn/torch difference is read against.
- hf: transformers `generate` in bfloat16 on one static left-padded batch (its usual batched
  use), per model and concurrency; its decode step is (full run - a one-token run) / (new - 1).
- kvserve: `kvserve up` (the model service and the manager as processes, the manager over its
  Unix socket), every request at once from one asyncio gRPC client, streamed token by token.
  Decode step: the median gap between a stream's consecutive tokens. Manager share: the engine's
  time waiting for the manager's answer (pipelined Step) over its step time (GetServerStats).
  Roofline share: the bytes a decode step must read (every matmul weight once,
  and every sequence's K and V so far, at the run's mean context) over the measured bandwidth,
  divided by the measured step.

Workload: the `bench` model (Llama, hidden 512, 8 layers) and `bench-1b` (hidden 2048, 16
layers, 32 heads / 8 KV heads, intermediate 8192, vocab 32000; ~1.1B parameters), random
weights, both served in bfloat16; 64 and 256 requests at once, prompts of 128-1024 random tokens,
256 new tokens, greedy, EOS ignored.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.model_size import matmul_params  # noqa: E402
from bench.prompts import make_prompts  # noqa: E402
from kvserve.model_service.kv_cache import bytes_per_token  # noqa: E402
from kvserve.model_service.model.config import ModelConfig  # noqa: E402
from kvserve.model_service.tiny_model import make_preset  # noqa: E402

# Only the kvserve part needs grpc and kvserve's stubs (bench/stream_timing.py, imported there):
# the other parts run on a machine whose grpcio is older than the stubs want.

PARTS = ("bandwidth", "agreement", "hf", "kvserve")


# ------------------------------------------------------------------------------ helpers

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Hands what torch's allocator keeps cached back to the device (for the next process)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Bytes/s of a large copy on `device`, counting bytes read and bytes written; the best of
    `reps` after a warm-up."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def step_bytes(cfg, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """What one decode step must read: (every matmul weight once, the K and V of each token of
    context in every layer); a ModelConfig, or anything with its fields."""
    layer, head = matmul_params(cfg)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return itemsize * (cfg.num_layers * layer + head), bytes_per_token(cfg, dtype)


def merge(path: Path, update: dict) -> dict:
    """Writes `update` into the JSON file at `path`, dicts merged at every depth."""
    data = json.loads(path.read_text()) if path.is_file() else {}

    def into(old: dict, new: dict) -> None:
        for key, value in new.items():
            if isinstance(value, dict) and isinstance(old.get(key), dict):
                into(old[key], value)
            else:
                old[key] = value

    into(data, update)
    path.write_text(json.dumps(data, indent=1, sort_keys=True))
    return data


# ---------------------------------------------------------------------------- agreement

class Tally:
    """One peer's greedy tokens and logits against the reference's, position by position."""

    def __init__(self) -> None:
        self.rows = self.same = self.decisive = self.decisive_same = 0
        self.max_diff = self.diff_sum = 0.0

    def add(self, logits: torch.Tensor, ref: torch.Tensor, greedy: torch.Tensor, sure: torch.Tensor) -> None:
        agree = logits.argmax(-1) == greedy
        diff = (logits - ref).abs()
        self.rows += len(greedy)
        self.same += int(agree.sum())
        self.decisive += int(sure.sum())
        self.decisive_same += int((agree & sure).sum())
        self.max_diff = max(self.max_diff, float(diff.max()))
        self.diff_sum += float(diff.mean(-1).sum())

    def result(self) -> dict:
        return {"agree": self.same / self.rows, "agree_decisive": self.decisive_same / max(1, self.decisive),
                "max_abs_diff": self.max_diff, "mean_abs_diff": self.diff_sum / self.rows}


def agreement(path: Path, device: torch.device, backend_name: str, n_prompts: int, lo: int, hi: int,
              steps: int, prompts: list[list[int]] | None = None) -> dict:
    """Teacher-forced greedy agreement and logit differences against the torch backend in bfloat16,
    step by step, as the engine batches (see the module's docstring), of: the candidate backend
    in the same steps; our model in float32; our bf16 model over each whole sequence in one pass
    (the same kernels, other shapes); transformers in bf16, one pass."""
    from transformers import AutoModelForCausalLM

    from kvserve.model_service.attention.select import select_backend, torch_attention
    from kvserve.model_service.dummy_step import prompt_batch
    from kvserve.model_service.engine.runner import ModelRunner
    from kvserve.model_service.engine.scheduler import Work
    from kvserve.model_service.kv_cache import KVCache
    from kvserve.model_service.model.loader import load_model

    bf16, _ = load_model(path, torch.bfloat16, device)
    f32, cfg = load_model(path, torch.float32, device)
    prompts = prompts or make_prompts(n_prompts, lo, hi, cfg.vocab_size, seed=7)
    candidate = select_backend(backend_name, device, None, torch.bfloat16)
    page_size = candidate.default_page_size()   # every run on the pages the candidate reads fastest
    per_seq = -(-(hi + steps) // page_size)

    def runner(model, backend, dtype) -> ModelRunner:
        kv = KVCache(cfg, n_prompts * per_seq, page_size, dtype, device)
        return ModelRunner(model, backend, kv, page_size, device)

    runners = {"candidate": runner(bf16, candidate, torch.bfloat16),
               "torch": runner(bf16, torch_attention(), torch.bfloat16),
               "float32": runner(f32, torch_attention(), torch.float32)}
    requests = [SimpleNamespace(tokens=list(p), page_table=list(range(i * per_seq, (i + 1) * per_seq)))
                for i, p in enumerate(prompts)]
    tallies = {name: Tally() for name in ("candidate", "float32", "torch_one_pass", "transformers_bf16",
                                          "candidate_vs_float32", "torch_vs_float32")}
    refs, greedies, sures, margins = [], [], [], []
    work = [Work(r, 0, len(r.tokens)) for r in requests]   # the prefill, then one token at a time
    for _ in range(steps + 1):
        logits = {name: r.execute(work).float() for name, r in runners.items()}
        ref = logits["torch"]
        top2 = ref.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        greedy = ref.argmax(-1)
        sure = margin >= ref.abs().amax(-1) / 128   # one to two bf16 ulps of the largest logit
        for name in ("candidate", "float32"):
            tallies[name].add(logits[name], ref, greedy, sure)
        exact = logits["float32"]   # and each bf16 backend against no rounding at all
        top2_32 = exact.topk(2, dim=-1).values
        sure32 = top2_32[:, 0] - top2_32[:, 1] >= exact.abs().amax(-1) / 128
        for name, source in (("candidate_vs_float32", "candidate"), ("torch_vs_float32", "torch")):
            tallies[name].add(logits[source], exact, exact.argmax(-1), sure32)
        refs.append(ref)
        greedies.append(greedy)
        sures.append(sure)
        margins.extend(margin.tolist())
        for r, token in zip(requests, greedy.tolist()):
            r.tokens.append(token)
        work = [Work(r, len(r.tokens) - 1, 1) for r in requests]

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    backend = torch_attention()
    for i, r in enumerate(requests):   # each whole sequence in one pass, logits at the compared rows
        ids = r.tokens[:len(prompts[i]) + steps]
        rows = torch.arange(len(prompts[i]) - 1, len(ids), device=device)
        batch = prompt_batch(len(ids), page_size, device)
        batch.input_ids = torch.tensor(ids, device=device)
        batch.logits_indices = rows
        scratch = KVCache(cfg, -(-len(ids) // page_size), page_size, torch.bfloat16, device)
        with torch.inference_mode():
            ours = bf16(batch, scratch.layers, backend, backend.prepare(batch)).float()
            theirs = hf(torch.tensor([ids], device=device)).logits[0, rows].float()
        ref = torch.stack([step[i] for step in refs])
        greedy = torch.stack([step[i] for step in greedies])
        sure = torch.stack([step[i] for step in sures])
        tallies["torch_one_pass"].add(ours, ref, greedy, sure)
        tallies["transformers_bf16"].add(theirs, ref, greedy, sure)
    return {"backend": candidate.name, "prompts": n_prompts, "positions": len(margins), "page_size": page_size,
            "decisive": int(sum(int(s.sum()) for s in sures)), "ties": sum(m == 0 for m in margins),
            **{name: t.result() for name, t in tallies.items()}}


# ------------------------------------------------------------------------- transformers

def hf_run(path: Path, device: torch.device, prompts: list[list[int]], new_tokens: int) -> dict:
    """transformers `generate`, bfloat16, one static left-padded batch (halved on out-of-memory)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()

    def generate(batch: list[list[int]], n: int) -> None:
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.shape[1] == width + n

    def timed(n: int, split: int) -> float:
        size = -(-len(prompts) // split)
        sync(device)
        start = time.perf_counter()
        for i in range(0, len(prompts), size):
            generate(prompts[i:i + size], n)
        sync(device)
        return time.perf_counter() - start

    with torch.inference_mode():
        generate(prompts[:2], 2)   # warm-up
        split = 1
        while True:
            try:
                prefill = timed(1, split)
                wall = timed(new_tokens, split)
                break
            except torch.cuda.OutOfMemoryError:
                split *= 2
                torch.cuda.empty_cache()
                if split > len(prompts):
                    raise
    return {"tok_s": len(prompts) * new_tokens / wall, "wall": wall, "prefill_s": prefill,
            "decode_step_ms": 1e3 * (wall - prefill) / (new_tokens - 1) / split, "batches": split}


# --------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--models", nargs="+", default=["bench", "bench-1b"], help="presets (model_service/tiny_model.py)")
    ap.add_argument("--model-dir", type=Path, default=None, help="where the presets are written (kept)")
    ap.add_argument("--agreement-models", nargs="+", default=None,
                    help="presets the agreement part measures (default: the first of --models)")
    ap.add_argument("--trained", type=int, default=0, metavar="STEPS",
                    help="agreement on the preset trained this many steps on a synthetic language "
                         "(bench/trained_model.py), with prompts in it: decisive choices, as a trained model's")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[128, 1024])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention-backend", default=None, help="the backend kvserve runs and that the "
                    "agreement part compares with torch (default: flash_attn on CUDA, else auto)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `kvserve up` argument")
    ap.add_argument("--json", type=Path, default=Path("gpu_bench.json"))
    ap.add_argument("--report", action="store_true", help="print what --json holds and stop")
    ap.add_argument("--quick", action="store_true", help="tiny model, 4 and 8 requests, 16 tokens, short prompts")
    args = ap.parse_args()
    if args.report:
        report(json.loads(args.json.read_text()))
        return
    if args.quick:
        args.models, args.concurrency, args.new_tokens, args.prompt_range = ["tiny"], [4, 8], 16, [16, 64]
    device = torch.device(args.device)
    if args.attention_backend is None:
        args.attention_backend = "flash_attn" if device.type == "cuda" else "auto"
    tmp = None
    if args.model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvserve-gpu-bench-")
        args.model_dir = Path(tmp.name)

    def model(preset: str) -> Path:
        path = args.model_dir / preset
        if not (path / "config.json").is_file():
            make_preset(path, preset)
        return path

    lo, hi = args.prompt_range
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__}
    before = json.loads(args.json.read_text()).get("env") if args.json.is_file() else None
    if before not in (None, env):
        print(f"warning: {args.json} holds results from {before}; this run is on {env}", flush=True)
    merge(args.json, {"env": env})
    if "bandwidth" in args.parts:
        merge(args.json, {"bandwidth": copy_bandwidth(device, 2 << 30 if device.type == "cuda" else 256 << 20)})
        release(device)
        print(f"bandwidth: {json.loads(args.json.read_text())['bandwidth'] / 1e12:.2f} TB/s", flush=True)
    if "agreement" in args.parts:
        steps, n = (8, 4) if args.quick else (64, 32)
        for preset in args.agreement_models or args.models[:1]:
            path, prompts, name = model(preset), None, preset
            if args.trained:   # the same shape, trained on a synthetic language; prompts in it
                from bench.trained_model import prompts as chain_prompts, train

                name = f"{preset}, trained {args.trained} steps"
                trained = args.model_dir / f"{preset}-trained-{args.trained}"
                if not (trained / "chain.json").is_file():
                    print("training:", json.dumps(train(preset, trained, args.trained, 512, 32, 256, args.device)),
                          flush=True)
                path, prompts = trained, chain_prompts(trained, n, lo, hi)
            result = agreement(path, device, args.attention_backend, n, lo, hi, steps, prompts)
            merge(args.json, {"agreement": {name: result}})
            release(device)   # the memory the kvserve part's profile run will look for
            print(f"agreement {name}:", json.dumps(result), flush=True)
    for preset in args.models:
        path = model(preset)
        cfg = ModelConfig.from_pretrained(path)
        vocab = cfg.vocab_size
        workloads = {c: make_prompts(c, lo, hi, vocab, seed=c) for c in args.concurrency}
        if "kvserve" in args.parts:
            from bench.stream_timing import run_stack

            server_args = ["--device", args.device, "--dtype", "bfloat16", "--attention-backend",
                           args.attention_backend, "--max-num-seqs", str(max(args.concurrency)),
                           "--max-num-batched-tokens", "8192", *args.server_arg]
            for c, result in run_stack(path, server_args, workloads, args.new_tokens, vocab):
                merge(args.json, {"kvserve": {f"{preset}/{c}": result}})
                print(f"kvserve {preset} {c}:", json.dumps(result), flush=True)
        if "hf" in args.parts:
            for c, prompts in workloads.items():
                result = hf_run(path, device, prompts, args.new_tokens)
                release(device)
                merge(args.json, {"hf": {f"{preset}/{c}": result}})
                print(f"hf {preset} {c}:", json.dumps(result), flush=True)
        weights, per_token = step_bytes(cfg)
        merge(args.json, {"models": {preset: {"weight_bytes": weights, "kv_bytes_per_token": per_token,
                                              "mean_prompt": {str(c): statistics.mean(map(len, p))
                                                              for c, p in workloads.items()}}}})
    merge(args.json, {"new_tokens": args.new_tokens})
    report(json.loads(args.json.read_text()))
    if tmp is not None:
        tmp.cleanup()


def report(data: dict) -> None:
    print(f"\n{data['env']['device']}, torch {data['env']['torch']}")
    bw = data.get("bandwidth")
    if bw:
        print(f"copy bandwidth (read + write): {bw / 1e12:.2f} TB/s")
    for preset, a in data.get("agreement", {}).items():
        print(f"{preset}: agreement with the torch backend's greedy tokens and logits, bfloat16, {a['prompts']} prompts, "
              f"{a['positions']} positions (teacher-forced), page size {a['page_size']}; 'decisive': the "
              f"{a['decisive']} positions whose top-2 margin is at least the largest logit / 128, one to two bf16 ulps of it "
              f"({a['ties']} exact ties):")
        names = {"candidate": f"{a['backend']} backend, same steps", "float32": "float32, same steps",
                 "torch_one_pass": "torch backend, one pass", "transformers_bf16": "transformers bf16, one pass",
                 "candidate_vs_float32": f"{a['backend']} against float32", "torch_vs_float32": "torch against float32"}
        print(f"  {'':<32} {'agree':>7} {'decisive':>9} {'max |diff|':>11} {'mean |diff|':>12}")
        for key, label in names.items():
            t = a[key]
            print(f"  {label:<32} {100 * t['agree']:>6.2f}% {100 * t['agree_decisive']:>8.2f}% "
                  f"{t['max_abs_diff']:>11.4f} {t['mean_abs_diff']:>12.5f}")
    runs = data.get("kvserve", {})
    hf = data.get("hf", {})
    if not (runs or hf):
        return
    new = data.get("new_tokens", 256)
    print(f"\n{'model/requests':<16} {'kvserve tok/s':>13} {'HF tok/s':>9} {'ratio':>6} {'step ms':>8} "
          f"{'HF step':>8} {'roofline':>9} {'manager':>8} {'mgr ms':>7}")
    for key in sorted(set(runs) | set(hf), key=lambda k: (k.split("/")[0], int(k.split("/")[1]))):
        preset, c = key.split("/")
        r, h = runs.get(key), hf.get(key)
        share = ""
        if r and bw and preset in data.get("models", {}):
            m = data["models"][preset]
            context = int(c) * (m["mean_prompt"][c] + (new - 1) / 2)
            step = m["weight_bytes"] + context * m["kv_bytes_per_token"]
            share = f"{100 * step / bw / (r['decode_step_ms'] / 1e3):.0f}%"
        if h and h.get("batches", 1) > 1:
            print(f"({key}: transformers ran in {h['batches']} batches for memory; its step is one batch's)")
        print(f"{key:<16} {r['tok_s'] if r else float('nan'):>13.0f} {h['tok_s'] if h else float('nan'):>9.0f} "
              f"{(r['tok_s'] / h['tok_s']) if r and h else float('nan'):>5.2f}x "
              f"{r['decode_step_ms'] if r else float('nan'):>8.2f} {h['decode_step_ms'] if h else float('nan'):>8.2f} "
              f"{share:>9} {100 * r['manager_share'] if r else float('nan'):>7.1f}% "
              f"{r['manager_ms'] if r else float('nan'):>7.2f}")


if __name__ == "__main__":
    main()
