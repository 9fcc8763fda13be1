"""The kvcache bench's report: percentiles, the machine, the tables and the ratios it prints."""

from __future__ import annotations

import cProfile
import io
import os
import platform
import pstats
import statistics
import time

from bench.kvcache_runs import RunResult
from bench.kvcache_trace import PS, StepRecord

# The comparison figures quoted in the issue (same trace, 2-core machine).
REFERENCE = [
    ("vLLM 0.33 KVCacheManager", 2900.0, "admission ~350 us at the median"),
    ("SGLang 0.5.23 RadixCache", 1300.0, ""),
]
GOAL_CORE_US = 660.0
GOAL_UNIX_RTT_US = 2000.0


# ----------------------------------------------------------------------------- reporting

def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


def us(ns_values) -> list[float]:
    return [v / 1000 for v in ns_values]


def steady(records: list[StepRecord], threshold: int) -> list[StepRecord]:
    return [r for r in records if r.running >= threshold]


def fmt(v: float, width: int = 7) -> str:
    if v != v:
        return "-".rjust(width)
    return (f"{v:.0f}" if v >= 100 else f"{v:.1f}").rjust(width)


def calibrate() -> float:
    """CPU ms for a fixed pure-Python loop (best of 5): compares machines and shows a busy one."""
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(20):
            sum(range(10000))
        best = min(best, (time.thread_time() - t0) * 1000)
    return best


def machine_facts() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import google.protobuf
    import grpc
    from google.protobuf.internal import api_implementation
    return {"nproc": os.cpu_count(), "cpu": cpu, "python": platform.python_version(),
            "grpcio": grpc.__version__,
            "protobuf": f"{google.protobuf.__version__} ({api_implementation.Type()})"}


def report(args, runs: list[RunResult], adm_rows, trace_adm, elapsed: float) -> None:
    thr = args.steady_threshold
    p = print
    core = runs[0]
    st = core.stats
    hit = st["prefix_hit_tokens"] / max(1, st["prefix_query_tokens"])
    n_steps = len(core.records) // max(1, len(core.means))
    steady_core = steady(core.records[:n_steps], thr)
    mean_of = lambda f: statistics.fmean(f(r) for r in steady_core) if steady_core else 0.0
    p()
    p(f"== KV-cache manager: {args.requests} requests, seed {args.seed}, page {PS}, {args.num_pages} pages, "
      f"<= {args.max_running} running, chunk {args.chunk or 'whole prompt'}, budget {args.budget} tokens/step")
    p(f"   {n_steps} steps per run, {len(steady_core)} with >= {thr} running "
      f"({sum(1 for r in steady_core if not r.admits)} quiet, {sum(1 for r in steady_core if r.admits)} with admissions); "
      f"a steady step carries {mean_of(lambda r: r.grows):.1f} grows, {mean_of(lambda r: r.commits):.1f} commits, "
      f"{mean_of(lambda r: r.admits):.2f} admissions, {mean_of(lambda r: r.releases):.2f} releases")
    p(f"   prefix hit rate {hit:.1%} ({st['prefix_hit_tokens']} / {st['prefix_query_tokens']} prompt tokens); "
      f"evictions {st['evictions']}; preemptions {st['preemptions_recompute']}; "
      f"refused admissions {core.engine.admit_refused}")
    p()
    p(f"us per Step, steps with >= {thr} running, {len(core.means)} run(s) pooled")
    p(f"  {'':<34}   mean    p50    p99 | quiet  mean    p99 | admit  mean    p99 |  cpu | build | each run's mean")
    base = None
    for run in runs:
        s = steady(run.records, thr)
        allv = us(r.step_ns for r in s)
        quiet = us(r.step_ns for r in s if not r.admits)
        adm = us(r.step_ns for r in s if r.admits)
        nan = float("nan")
        build = statistics.fmean(us(r.build_ns for r in s)) if s else nan
        cpu = statistics.fmean(us(r.cpu_ns for r in s)) if s and s[0].cpu_ns else nan
        mean = statistics.fmean(allv) if allv else nan
        if base is None:
            base = mean
        p(f"  {run.name:<34}{fmt(mean)}{fmt(pct(allv, 50))}{fmt(pct(allv, 99))} |"
          f"      {fmt(statistics.fmean(quiet) if quiet else nan)}{fmt(pct(quiet, 99))} |"
          f"      {fmt(statistics.fmean(adm) if adm else nan)}{fmt(pct(adm, 99))} |{fmt(cpu, 5)} |{fmt(build, 6)} | "
          + " ".join(f"{v:.0f}" for v in run.means))
    for name, ref, _ in REFERENCE:
        p(f"  {'(ref) ' + name:<34}{fmt(ref)}")
    p(f"  {'(goal) core':<34}{fmt(GOAL_CORE_US)}")
    p(f"  {'(goal) Unix socket round trip':<34}{fmt(GOAL_UNIX_RTT_US)}")
    p("  quiet: steps without admissions; cpu: this thread's CPU time (in-process only); build: making the")
    p("  request message (not in the step time)")
    p()
    for run in runs[1:]:
        s = steady(run.records, thr)
        if s:
            mean = statistics.fmean(us(r.step_ns for r in s))
            p(f"  ratio {run.name} / {runs[0].name}: {mean / base:.2f}x  (+{mean - base:.0f} us per step)")
    for run in runs:
        s = steady(run.records, thr)
        if s and s[0].extra:
            cols = list(zip(*(r.extra for r in s)))
            m = [statistics.fmean(c) / 1000 for c in cols[:5]]
            build = statistics.fmean(us(r.build_ns for r in s))
            p(f"  what a remote Step does besides the transport (means, emulated in-process): client builds the "
              f"pb.StepRequest {build:.0f} us,")
            p(f"    serialize+parse request {m[0]:.0f}, convert.step_request_from_pb {m[1]:.0f}, core step {m[2]:.0f}, "
              f"convert.step_plan_to_pb {m[3]:.0f}, serialize+parse response {m[4]:.0f}; "
              f"request {statistics.fmean(cols[5]) / 1024:.1f} KiB, response {statistics.fmean(cols[6]) / 1024:.2f} KiB")
    for run in runs:
        if run.server_cpu_us:
            inproc = [statistics.fmean(us(r.cpu_ns for r in x.records)) for x in runs if x.records and x.records[0].cpu_ns]
            p(f"  server process CPU per Step (all threads, all steps), {run.name}: "
              f"{statistics.fmean(run.server_cpu_us):.0f} us"
              + (f"; the in-process core's thread CPU per Step (all steps): {inproc[0]:.0f} us" if inproc else ""))
    for run in runs:
        if run.empty_rtt:
            v = us(run.empty_rtt)
            p(f"  empty Step round trip, {run.name}: mean {statistics.fmean(v):.0f} us, p50 {pct(v, 50):.0f}, "
              f"p99 {pct(v, 99):.0f}")
    if adm_rows:
        p()
        p("admission us (in-process core, one `step(needs=[Admit])` of the whole prompt, tree warm from the trace;")
        p("  medians of wall clock and of thread CPU time)")
        p("  prompt tokens    hit: p50   cpu p50 |  miss: p50   cpu p50")
        for row in adm_rows:
            lo, hi = row["bin"]
            p(f"  {lo:>5}-{hi:<5}       {fmt(pct(us(row['hit']), 50))}   {fmt(pct(us(row['hit_cpu']), 50))} |"
              f"      {fmt(pct(us(row['miss']), 50))}   {fmt(pct(us(row['miss_cpu']), 50))}")
        xs = [row["tokens"] for row in adm_rows]
        slopes = []
        for case in ("hit_cpu", "miss_cpu"):
            ys = [pct(us(row[case]), 50) for row in adm_rows]
            slopes.append(statistics.linear_regression(xs, ys).slope * 1000)
        p(f"  slope (cpu p50): hit {slopes[0]:.0f} us, miss {slopes[1]:.0f} us per 1000 prompt tokens "
          "(hit: every page but the last cached; miss: nothing cached, pages taken by eviction)")
    if trace_adm:
        v, c = us(trace_adm[0]), us(trace_adm[1])
        p(f"  trace-like new prompts (a cached shared prefix + a fresh 16-512 token suffix): p50 {pct(v, 50):.0f} us "
          f"(cpu {pct(c, 50):.0f}), p99 {pct(v, 99):.0f}   (ref: vLLM 0.33 ~350 us at the median)")
    p()
    p(f"total bench time {elapsed:.0f} s")


def summary(args, runs: list[RunResult], adm_rows, trace_adm) -> dict:
    thr = args.steady_threshold
    out: dict = {"requests": args.requests, "seed": args.seed, "backends": {}}
    if runs:
        st = runs[0].stats
        out["prefix_hit_rate"] = st["prefix_hit_tokens"] / max(1, st["prefix_query_tokens"])
        out["steps"] = len(runs[0].records) // max(1, args.repeat)
    for run in runs:
        s = steady(run.records, thr)
        allv = us(r.step_ns for r in s)
        quiet = us(r.step_ns for r in s if not r.admits)
        adm = us(r.step_ns for r in s if r.admits)
        d = {"mean": statistics.fmean(allv) if allv else None, "p50": pct(allv, 50), "p99": pct(allv, 99),
             "quiet_mean": statistics.fmean(quiet) if quiet else None, "quiet_p99": pct(quiet, 99),
             "admit_mean": statistics.fmean(adm) if adm else None, "admit_p99": pct(adm, 99),
             "build_mean": statistics.fmean(us(r.build_ns for r in s)) if s else None,
             "cpu_mean": statistics.fmean(us(r.cpu_ns for r in s)) if s and s[0].cpu_ns else None,
             "run_means": run.means}
        if s and s[0].extra:
            cols = list(zip(*(r.extra for r in s)))
            d["breakdown"] = dict(zip(("wire_in", "step_from_pb", "core", "plan_to_pb", "wire_out"),
                                      (statistics.fmean(c) / 1000 for c in cols[:5])))
        if run.empty_rtt:
            v = us(run.empty_rtt)
            d["empty_rtt_mean"], d["empty_rtt_p99"] = statistics.fmean(v), pct(v, 99)
        if run.server_cpu_us:
            d["server_cpu_per_step"] = statistics.fmean(run.server_cpu_us)
        if run.records and run.records[0].cpu_ns:
            d["cpu_per_step_all"] = statistics.fmean(us(r.cpu_ns for r in run.records))
        out["backends"][run.name] = d
    out["admission"] = [{"bin": row["bin"], "hit_p50": pct(us(row["hit"]), 50), "miss_p50": pct(us(row["miss"]), 50),
                         "hit_cpu_p50": pct(us(row["hit_cpu"]), 50), "miss_cpu_p50": pct(us(row["miss_cpu"]), 50)}
                        for row in adm_rows]
    if trace_adm:
        out["trace_admission_median"] = pct(us(trace_adm[0]), 50)
        out["trace_admission_cpu_median"] = pct(us(trace_adm[1]), 50)
    return out


def write_json(path, args, facts, runs, adm_rows, trace_adm) -> None:
    import json
    d = summary(args, runs, adm_rows, trace_adm)
    d["machine"] = facts
    with open(path, "w") as f:
        json.dump(d, f, indent=1)


def print_profile(title: str, prof: cProfile.Profile, top: int = 25) -> None:
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        ps = pstats.Stats(prof, stream=out).strip_dirs().sort_stats(key)
        ps.print_stats(top)
        text = out.getvalue()
        start = text.find("   ncalls")
        print(f"\n--- {title}: top {top} by {key} ---")
        head = text[:start].strip().splitlines()
        print("\n".join(line for line in head if "function calls" in line))
        print(text[start:].rstrip())
