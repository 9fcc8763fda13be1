"""Driving the kvcache bench: the trace against one backend, and admissions timed alone."""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import dataclass, field

from bench.kvcache_trace import EPOCH, VOCAB, Engine, Request, StepRecord

BINS = [(256, 512), (512, 1024), (1024, 1536), (1536, 2048), (2048, 2560)]


# ----------------------------------------------------------------------------- driving

@dataclass
class RunResult:
    name: str
    records: list[StepRecord]
    stats: dict
    wall_s: float
    engine: Engine
    empty_rtt: list[int] = field(default_factory=list)
    server_cpu_us: list[float] = field(default_factory=list)  # remote: server process CPU per Step, per run
    means: list[float] = field(default_factory=list)  # steady-state mean us of each repeat


def run_trace(backend, requests: list[Request], args) -> RunResult:
    engine = Engine(requests, args.seed, args.max_running, args.chunk, args.budget)
    records = []
    clock = time.perf_counter_ns
    gc.collect()
    t_start = time.perf_counter()
    while not engine.done():
        d = engine.build()
        t0 = clock()
        msg = backend.build(d)
        t1 = clock()
        results, preempted, step_ns, cpu_ns, extra = backend.step(msg)
        engine.apply(d, results, preempted)
        engine.forward()
        records.append(StepRecord(len(engine.running), len(d.admits), len(d.grows), len(d.commits),
                                  len(d.releases), t1 - t0, step_ns, cpu_ns, extra))
        if len(records) > 100_000:
            raise RuntimeError("the trace does not finish (engine bug?)")
    wall = time.perf_counter() - t_start
    return RunResult(backend.name, records, backend.stats(), wall, engine)


def admission_bench(m, n_per_bin: int, seed: int) -> list[dict]:
    """Times single admissions (`step(needs=[Admit])`, whole prompt) on a manager whose
    tree is warm. Per sample: a fresh random prompt is admitted (the miss case: nothing
    cached), committed as fully computed and released, so its pages stay in the tree; then
    the same prompt is admitted again under a new request id (the hit case: every page but
    the one holding the last token is cached) and released. Releases are not timed."""
    from kvserve.kvcache_service.core import Admit, Commit, StepRequest
    rng = random.Random(seed + 2)
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    rows = []
    k = 0
    for lo, hi in BINS:
        hit, miss, cached, lengths = [], [], [], []
        hit_cpu, miss_cpu = [], []
        for _ in range(n_per_bin):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi - 1))]
            lengths.append(len(prompt))
            for case, case_cpu in ((miss, miss_cpu), (hit, hit_cpu)):
                k += 1
                req = StepRequest(epoch=EPOCH, needs=[Admit(f"adm{k}", prompt)])
                c0 = cpu()
                t0 = clock()
                plan = m.step(req)
                t1 = clock()
                case_cpu.append(cpu() - c0)
                r = plan.results[0]
                if not r.granted:
                    raise RuntimeError(f"admission refused: {r.reason}")
                case.append(t1 - t0)
                if case is miss:
                    m.step(StepRequest(epoch=EPOCH, commits=[Commit(r.seq_id, len(prompt))]))
                else:
                    cached.append(r.cached_tokens / len(prompt))
                m.step(StepRequest(epoch=EPOCH, releases=[r.seq_id]))
        rows.append({"bin": (lo, hi), "hit": hit, "miss": miss, "hit_cpu": hit_cpu, "miss_cpu": miss_cpu,
                     "cached": statistics.fmean(cached),
                     "tokens": statistics.fmean(lengths)})
    return rows


def trace_admissions(m, prefixes: list[list[int]], n: int, seed: int) -> list[int]:
    """Admission times for new prompts drawn like the trace's: one of the shared
    prefixes (cached) + a fresh suffix of 16-512 tokens (a miss)."""
    from kvserve.kvcache_service.core import Admit, StepRequest
    rng = random.Random(seed + 3)
    prompts = [rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(16, 512))]
               for _ in range(n)]
    times, cpus = [], []
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    for i, prompt in enumerate(prompts):
        req = StepRequest(epoch=EPOCH, needs=[Admit(f"tadm{i}", prompt)])
        c0 = cpu()
        t0 = clock()
        plan = m.step(req)
        t1 = clock()
        cpus.append(cpu() - c0)
        m.step(StepRequest(epoch=EPOCH, releases=[plan.results[0].seq_id]))
        times.append(t1 - t0)
    return times, cpus
