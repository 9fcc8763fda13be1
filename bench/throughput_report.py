"""bench/throughput.py's report: the throughput table docs/benchmarks.md carries, the GEMM
comparison (--cpu-gemms), where the step time went, the multi-turn times and the goals."""

from __future__ import annotations

import statistics

ALONE = "engine alone"   # the row of bench/engine_alone.py's run
HONEST = "best GEMM + bandwidth"   # the roofline the goal is read against (throughput.roofline_seconds)


def print_throughput(rows: list) -> None:
    """The markdown table docs/benchmarks.md carries: each roofline and kvserve's share of it,
    a row per new-token count and way of running kvserve."""
    names = list(rows[0][5])
    print("\n| new tokens | kvserve | kvserve tok/s | HF generate tok/s | HF generate_batch tok/s | "
          + " | ".join(f"roofline ({name}) tok/s | kvserve / it" for name in names)
          + " | kvserve / HF generate |")
    print("|---" * (6 + 2 * len(names)) + "|")
    for n, how, k, static, batch, roofs in rows:
        b = f"{batch['tok_s']:.1f}" if "tok_s" in batch else f"n/a ({batch['error']})"
        shares = " | ".join(f"{r:.1f} | {100 * k['tok_s'] / r:.0f}%" for r in roofs.values())
        print(f"| {n} | {how} | {k['tok_s']:.1f} | {static['tok_s']:.1f} | {b} | {shares} | "
              f"{k['tok_s'] / static['tok_s']:.2f}x |")


def print_goals(rows: list, turns: dict, peers: dict | None = None) -> None:
    """The issues' goals, each against this run's figures; peers: new tokens -> llama.cpp's
    server run on the same prompts (bench/llama_cpp_peer.py), where it ran.

    The roofline goal is read against the honest roofline: per phase the larger of FLOPs over
    the best GEMM rate measured and bytes over the memory bandwidth measured (decode is bound by
    bytes). The table shows every rate."""
    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    print("\ngoals:")
    for how in dict.fromkeys(row[1] for row in rows):
        mine = [row for row in rows if row[1] == how]
        vs_hf = [k["tok_s"] / static["tok_s"] for _, _, k, static, _, _ in mine]
        vs_roof = [k["tok_s"] / roofs[HONEST] for _, _, k, _, _, roofs in mine]
        print(f"  {how}{' (not the goal: no gRPC)' if how.startswith(ALONE) else ''}:")
        print(f"    >= 2x HF generate: {', '.join(f'{r:.2f}x' for r in vs_hf)}  {verdict(min(vs_hf) >= 2)}")
        print(f"    >= 75% of the roofline (best GEMM rate, memory bandwidth): "
              f"{', '.join(f'{100 * r:.0f}%' for r in vs_roof)}  {verdict(min(vs_roof) >= 0.75)}")
        if peers:
            vs_llama = [k["tok_s"] / peers[n]["tok_s"] for n, _, k, *_ in mine if n in peers]
            print(f"    >= 2x llama.cpp's server: {', '.join(f'{r:.2f}x' for r in vs_llama)}  "
                  f"{verdict(min(vs_llama) >= 2)}")
    growth = turns[True][-1] / turns[True][0]
    print(f"  turn-{len(turns[True])} time to first token <= 1.5x turn 1, cache on: {growth:.2f}x  "
          f"{verdict(growth <= 1.5)}")


def print_comparison(results: dict, labels: list[str]) -> None:
    """Each variant's runs (interleaved; labels such as "GEMM native", "KV bfloat16"), their
    spread, and the ratio of medians to the first variant's."""
    print("\nvariants compared, tok/s of each interleaved run:")
    for n, how in dict.fromkeys((n, how.rsplit(", ", 1)[0]) for n, how in results):
        medians = {}
        for label in labels:
            runs = [k["tok_s"] for k in results.get((n, f"{how}, {label}"), [])]
            if not runs:
                continue
            medians[label] = statistics.median(runs)
            spread = (max(runs) - min(runs)) / medians[label]
            print(f"  {n} new tokens, {how}, {label}: {', '.join(f'{t:.1f}' for t in runs)}"
                  f"   median {medians[label]:.1f}, spread {100 * spread:.0f}%")
        first = labels[0]
        for label in labels[1:]:
            if first in medians and label in medians:
                print(f"    {label} / {first}: {medians[label] / medians[first]:.3f}x")


def print_steps(rows: list) -> None:
    print("\nwhere kvserve's step time went (engine phase timers):")
    for n, how, k, *_ in rows:
        total = sum(k["phases"].values())
        split = ", ".join(f"{name} {100 * v / total:.1f}%" for name, v in k["phases"].items())
        print(f"  {n} new tokens, {how}: {k['steps']} steps, "
              f"{1e3 * total / max(1, k['steps']):.1f} ms/step; {split}")
        if "cpu" in k:   # on 2 cores, CPU outside the engine costs the forward about as much wall time
            print(f"    {k['wall']:.2f} s wall; CPU s: " + ", ".join(f"{name} {s:.2f}" for name, s in k["cpu"].items()))


def print_turns(turns: dict, count: int, conversations: int) -> None:
    print(f"\nmulti-turn time to first token (ms), turns 1..{count}, +64 tokens per turn, "
          f"median of {conversations} conversations:")
    for caching, ttfts in turns.items():
        label = "cache on " if caching else "cache off"
        print(f"  {label}: {' '.join(f'{t:.1f}' for t in ttfts)}   last/first {ttfts[-1] / ttfts[0]:.2f}x")
