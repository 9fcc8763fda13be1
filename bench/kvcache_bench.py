#!/usr/bin/env python
"""Benchmark of the KV-cache manager: the core in-process, and the gRPC service
over a Unix socket and over TCP loopback (server in its own process).

    .venv/bin/python bench/kvcache_bench.py            # full run, ~1-2 min on 2 cores
    .venv/bin/python bench/kvcache_bench.py --quick    # ~30 s
    .venv/bin/python bench/kvcache_bench.py --profile  # cProfile of the step path

A seeded trace (2000 requests; prompts = one of 50 shared prefixes of 256-2048
tokens + a unique suffix of 16-512 tokens; outputs of 16-256 tokens) is driven
by a simulated engine (no torch) that sends ONE Step per iteration, the way the
model service will: lazy commits (only when a page fills, and at prefill end),
Grow only when the next token needs a new page, chunked admissions under a
token budget while fewer than --max-running sequences run, releases of the
finished. The same trace runs against every backend; the plans must agree.

To measure another version of the manager beside this one, run the bench from a git worktree
of it with its own install (`git worktree add ../other REV && make -C ../other install`); the
header prints which kvcache_service was imported.

The parts: kvcache_trace.py (the workload and the simulated engine), kvcache_backends.py (core,
protobuf in-process, gRPC), kvcache_runs.py (a trace against one backend; admissions alone),
kvcache_report.py (the tables and ratios).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kvcache_backends import CoreBackend, GrpcBackend, PbInProcBackend, free_tcp_port  # noqa: E402
from bench.kvcache_report import calibrate, machine_facts, print_profile, report, steady, write_json  # noqa: E402
from bench.kvcache_runs import RunResult, admission_bench, run_trace, trace_admissions  # noqa: E402
from bench.kvcache_trace import make_trace  # noqa: E402


# ----------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="requests in the trace (default 2000)")
    ap.add_argument("--quick", action="store_true",
                    help="a ~30 s run: 1000 requests, one run per backend, fewer admission samples")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of the trace per backend, pooled (default 3; --quick: 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-pages", type=int, default=20000)
    ap.add_argument("--max-running", type=int, default=256, help="sequences running at once (= max_seqs)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (max_tokens); 0: whole prompts")
    ap.add_argument("--budget", type=int, default=2048, help="prefill tokens per step")
    ap.add_argument("--steady-threshold", type=int, default=250, help="'at 256 running' means >= this many")
    ap.add_argument("--admission-samples", type=int, default=60, help="admissions timed per bin and case")
    ap.add_argument("--backends", default="core,pb,unix,unix-stream,tcp",
                    help="comma list of: core (in-process), pb (in-process via protobuf+convert), unix, "
                         "unix-stream (the engine's StepStream), tcp")
    ap.add_argument("--profile", action="store_true",
                    help="run the trace in-process under cProfile and print the top 25 functions "
                         "(core step; client pb build; server conversion)")
    ap.add_argument("--server-profile", metavar="PREFIX",
                    help="cProfile each server process (first run); stats go to PREFIX-unix.prof / PREFIX-tcp.prof "
                         "(read them with: python -m pstats FILE)")
    ap.add_argument("--json", metavar="PATH", help="also write the summary figures as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        if "--requests" not in " ".join(sys.argv if argv is None else argv):
            args.requests = 1000
        args.admission_samples = min(args.admission_samples, 20)
        if "--repeat" not in " ".join(sys.argv if argv is None else argv):
            args.repeat = 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    import kvserve.kvcache_service as kvcache_service
    facts = machine_facts()
    print(f"machine: {facts['nproc']} cpus, {facts['cpu']}, Python {facts['python']}, grpcio {facts['grpcio']}, "
          f"protobuf {facts['protobuf']}")
    print(f"kvcache_service from {os.path.dirname(kvcache_service.__file__)}")
    facts["calibration_ms"] = calibrate()
    facts["loadavg_start"] = os.getloadavg()[0]
    print(f"calibration: {facts['calibration_ms']:.1f} ms CPU for 20 x sum(range(10000)); "
          f"load average {facts['loadavg_start']:.2f} (>0.1 means other work shares the {facts['nproc']} cpus)")
    prefixes, requests = make_trace(args.requests, args.seed)
    print(f"trace: {len(requests)} requests, {len(prefixes)} prefixes, prompt tokens "
          f"{sum(len(r.prompt) for r in requests)}, output tokens {sum(r.output_len for r in requests)}")

    if args.profile:
        core = CoreBackend(args.num_pages, args.max_running)
        core.profiler = cProfile.Profile()
        run = run_trace(core, requests, args)
        print(f"in-process trace under cProfile: {len(run.records)} steps, {run.wall_s:.1f} s")
        print_profile("core step (m.step)", core.profiler)
        pbb = PbInProcBackend(args.num_pages, args.max_running)
        pbb.profilers = {k: cProfile.Profile() for k in ("client build", "client build (simple)",
                                                           "server convert", "core step")}
        run_trace(pbb, requests, args)
        print_profile("client pb.StepRequest build: build_pb (in place)", pbb.profilers["client build"])
        print_profile("client pb.StepRequest build: build_pb_simple (constructors)",
                      pbb.profilers["client build (simple)"])
        print_profile("server convert (step_from_pb + plan_to_pb)", pbb.profilers["server convert"])
        return 0

    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    runs: list[RunResult] = []
    adm_rows, trace_adm = [], ()
    tmp = tempfile.mkdtemp(prefix="kvbench-")
    reference = None
    for b in wanted:
        merged: RunResult | None = None
        for rep in range(args.repeat):
            if b == "core":
                backend = CoreBackend(args.num_pages, args.max_running)
            elif b == "pb":
                backend = PbInProcBackend(args.num_pages, args.max_running)
            elif b in ("unix", "tcp", "unix-stream"):
                listen = f"unix://{tmp}/kv.sock" if b != "tcp" else f"127.0.0.1:{free_tcp_port()}"
                sp = f"{args.server_profile}-{b}.prof" if args.server_profile and rep == 0 else None
                name = {"unix": "gRPC Unix socket", "tcp": "gRPC TCP loopback",
                        "unix-stream": "gRPC Unix, StepStream"}[b]
                backend = GrpcBackend(name, listen, args.num_pages, args.max_running, sp,
                                      stream=b == "unix-stream")
            else:
                raise SystemExit(f"unknown backend {b!r}")
            print(f"running the trace: {backend.name} ({rep + 1}/{args.repeat}) ...", flush=True)
            try:
                cpu0 = backend.server_cpu_s() if isinstance(backend, GrpcBackend) else 0.0
                run = run_trace(backend, requests, args)
                if isinstance(backend, GrpcBackend):
                    run.server_cpu_us.append((backend.server_cpu_s() - cpu0) * 1e6 / len(run.records))
                if isinstance(backend, GrpcBackend):
                    run.empty_rtt = backend.empty_rtt(200 if args.quick else 500)
                if b == "core" and rep == 0 and args.admission_samples > 0:
                    print("timing admissions ...", flush=True)
                    # trace-like first: the hit/miss bins churn enough pages to evict the prefixes
                    trace_adm = trace_admissions(backend.m, prefixes, 5 * args.admission_samples, args.seed)
                    adm_rows = admission_bench(backend.m, args.admission_samples, args.seed)
            finally:
                backend.close()
            # every run of every backend must make the same decisions
            fingerprint = (len(run.records), run.stats["prefix_hit_tokens"], run.stats["evictions"],
                           run.stats["preemptions_recompute"])
            if reference is None:
                reference = (fingerprint, run.name)
            elif fingerprint != reference[0]:
                print(f"WARNING: {run.name} did not replay the same plan as {reference[1]}: "
                      f"(steps, hit tokens, evictions, preemptions) {fingerprint} != {reference[0]}")
            run.means.append(statistics.fmean(r.step_ns for r in steady(run.records, args.steady_threshold)) / 1000
                             if steady(run.records, args.steady_threshold) else float("nan"))
            if merged is None:
                merged = run
            else:
                merged.records += run.records
                merged.wall_s += run.wall_s
                merged.empty_rtt += run.empty_rtt
                merged.server_cpu_us += run.server_cpu_us
                merged.means += run.means
        runs.append(merged)
    try:
        os.rmdir(tmp)
    except OSError:
        pass
    if not runs or runs[0].name != CoreBackend.name:
        print("(the first backend is the baseline of the ratios)")
    facts["loadavg_end"] = os.getloadavg()[0]
    report(args, runs, adm_rows, trace_adm, time.perf_counter() - t_start)
    print(f"load average at the end {facts['loadavg_end']:.2f}")
    if args.json:
        write_json(args.json, args, facts, runs, adm_rows, trace_adm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
