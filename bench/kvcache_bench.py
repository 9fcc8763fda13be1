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

To measure a modified copy of kvcache_service without touching the real one:
    cp -r kvcache_service /tmp/kvscratch/ && PYTHONPATH=/tmp/kvscratch .venv/bin/python bench/kvcache_bench.py
(the header prints which kvcache_service was imported; server processes inherit PYTHONPATH).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import platform
import pstats
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field

PS = 16  # page size (tokens)
VOCAB = 32000
EPOCH = 1

# The comparison figures quoted in the issue (same trace, 2-core machine).
REFERENCE = [
    ("vLLM 0.33 KVCacheManager", 2900.0, "admission ~350 us at the median"),
    ("SGLang 0.5.23 RadixCache", 1300.0, ""),
]
GOAL_CORE_US = 660.0
GOAL_UNIX_RTT_US = 2000.0
BINS = [(256, 512), (512, 1024), (1024, 1536), (1536, 2048), (2048, 2560)]


# ----------------------------------------------------------------------------- trace

@dataclass(slots=True)
class Request:
    rid: str
    prompt: list[int]
    output_len: int
    prefix: int  # index of its shared prefix


def make_prefixes(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(256, 2048))] for _ in range(n)]


def make_trace(num_requests: int, seed: int, num_prefixes: int = 50) -> tuple[list[list[int]], list[Request]]:
    rng = random.Random(seed)
    prefixes = make_prefixes(rng, num_prefixes)
    reqs = []
    for i in range(num_requests):
        p = rng.randrange(num_prefixes)
        suffix = [rng.randrange(VOCAB) for _ in range(rng.randint(16, 512))]
        reqs.append(Request(f"r{i}", prefixes[p] + suffix, rng.randint(16, 256), p))
    return prefixes, reqs


# ----------------------------------------------------------------------------- engine

class SimSeq:
    __slots__ = ("rid", "seq_id", "tokens", "known", "computed", "committed", "prompt_len",
                 "slots", "generated", "output_len", "sched")

    def __init__(self, rid: str, tokens: list[int], output_len: int, generated: int) -> None:
        self.rid = rid
        self.seq_id = -1
        self.tokens = tokens            # every token of the sequence so far (prompt + sampled)
        self.known = len(tokens)        # tokens the manager knows (sent by admission / commits)
        self.computed = 0               # tokens whose K/V are written
        self.committed = 0              # num_computed of the last commit (or admission's cached)
        self.prompt_len = len(tokens)   # prefill ends when computed reaches this
        self.slots = 0                  # pages held * PS
        self.generated = generated      # tokens sampled so far (kept across a recompute)
        self.output_len = output_len
        self.sched = 0                  # tokens this iteration's forward pass computes


@dataclass(slots=True)
class StepDesc:
    """The engine's plain description of one Step; each backend builds its own message."""
    releases: list[int]
    commits: list[tuple[int, int, list[int]]]   # (seq id, num_computed, appended token ids)
    grows: list[tuple[int, int]]                # (seq id, total slots)
    admits: list[tuple[str, list[int], int | None]]  # (request id, prompt, max_tokens)


@dataclass(slots=True)
class StepRecord:
    running: int       # sequences running after the step
    admits: int        # admissions asked for
    grows: int
    commits: int
    releases: int
    build_ns: int      # building the backend's request message
    step_ns: int       # the step call / the RPC round trip (wall clock)
    cpu_ns: int        # in-process only: this thread's CPU time in the step call (0 for remote)
    extra: tuple = ()  # backend-specific timings


class Engine:
    """Continuous batching without a model: what the model service's scheduler does
    around one Step per iteration. Generated tokens are seeded random ids."""

    def __init__(self, requests: list[Request], seed: int, max_running: int, chunk: int, budget: int) -> None:
        self.waiting: deque[tuple[Request, list[int], int]] = deque((r, r.prompt, 0) for r in requests)
        self.running: dict[int, SimSeq] = {}
        self.to_release: list[int] = []
        self.rng = random.Random(seed + 1)
        self.max_running = max_running
        self.chunk = chunk
        self.budget = budget
        self.finished = 0
        self.preempted = 0
        self.admit_refused = 0
        self._pending: list[tuple[Request, list[int], int]] = []

    def done(self) -> bool:
        return not self.waiting and not self.running and not self.to_release

    def build(self) -> StepDesc:
        commits, grows, admits = [], [], []
        budget = self.budget
        for s in self.running.values():
            c = s.computed
            if c // PS > s.committed // PS or (c >= s.prompt_len > s.committed):
                commits.append((s.seq_id, c, s.tokens[s.known:]))
                s.known = len(s.tokens)
                s.committed = c
            if c < s.prompt_len:  # chunked prefill continues
                n = min(self.chunk or s.prompt_len, s.prompt_len - c, budget)
                s.sched = n
                budget -= n
                if n and c + n > s.slots:
                    grows.append((s.seq_id, c + n))
            else:                 # decode: the last sampled token needs a slot
                s.sched = 1
                if c + 1 > s.slots:
                    grows.append((s.seq_id, c + 1))
        room = self.max_running - len(self.running)
        pending = self._pending = []
        for item in self.waiting:
            if room <= 0 or budget <= 0:
                break
            req, prompt, _ = item
            if self.chunk:
                max_tokens = min(self.chunk, budget)
                budget -= max_tokens
            else:
                max_tokens = None
                budget -= len(prompt)
            admits.append((req.rid, prompt, max_tokens))
            pending.append(item)
            room -= 1
        releases, self.to_release = self.to_release, []
        return StepDesc(releases, commits, grows, admits)

    def apply(self, desc: StepDesc, results, preempted) -> None:
        """Applies a plan (core StepPlan or pb StepResponse: same field names)."""
        running = self.running
        victims = set()
        for p in preempted:
            victims.add(p.seq_id)
        n_grow = len(desc.grows)
        for (seq_id, _), r in zip(desc.grows, results):
            if r.granted:
                running[seq_id].slots += len(r.page_ids) * PS
        admitted = 0
        for item, r in zip(self._pending, results[n_grow:]):
            if not r.granted:
                self.admit_refused += 1
                break
            req, prompt, generated = item
            s = SimSeq(req.rid, list(prompt), req.output_len, generated)
            s.seq_id = r.seq_id
            s.slots = len(r.page_ids) * PS
            s.computed = s.committed = r.cached_tokens
            s.sched = r.num_tokens
            running[r.seq_id] = s
            admitted += 1
        for _ in range(admitted):
            self.waiting.popleft()
        for seq_id in victims:  # RECOMPUTE: back to the head of the queue with all its tokens
            s = running.pop(seq_id)
            self.waiting.appendleft((Request(s.rid, [], s.output_len, -1), s.tokens, s.generated))
            self.preempted += 1

    def forward(self) -> None:
        """The model's forward pass: scheduled tokens get K/V, finished prefills and
        decodes sample one token."""
        rnd = self.rng.randrange
        done = []
        for s in self.running.values():
            n = s.sched
            if not n:
                continue
            s.computed += n
            if s.computed >= len(s.tokens):  # prefill finished or decode step: sample
                s.tokens.append(rnd(VOCAB))
                s.generated += 1
                if s.generated >= s.output_len:
                    done.append(s.seq_id)
            s.sched = 0
        for seq_id in done:
            del self.running[seq_id]
            self.to_release.append(seq_id)
            self.finished += 1


# ----------------------------------------------------------------------------- backends

class CoreBackend:
    """The core, called in-process with core StepRequest objects."""
    name = "in-process core"

    def __init__(self, num_pages: int, max_seqs: int) -> None:
        from kvserve.kvcache_service.core import KVCacheManager, ManagerConfig
        from kvserve.kvcache_service.contract import types as t
        self.t = t
        self.m = KVCacheManager(ManagerConfig(num_pages=num_pages, page_size=PS, max_seqs=max_seqs))
        self.m.register(EPOCH, PS, num_pages)
        self.profiler: cProfile.Profile | None = None

    def build(self, d: StepDesc):
        t = self.t
        return t.StepRequest(
            epoch=EPOCH, releases=d.releases,
            commits=[t.Commit(s, n, toks) for s, n, toks in d.commits],
            needs=[t.Grow(s, n) for s, n in d.grows] + [t.Admit(r, p, "", mt) for r, p, mt in d.admits])

    def step(self, req):
        clock, cpu = time.perf_counter_ns, time.thread_time_ns
        if self.profiler is None:
            c0 = cpu()
            t0 = clock()
            plan = self.m.step(req)
            t1 = clock()
            c1 = cpu()
        else:
            c0 = cpu()
            t0 = clock()
            self.profiler.enable()
            plan = self.m.step(req)
            self.profiler.disable()
            t1 = clock()
            c1 = cpu()
        return plan.results, plan.preempted, t1 - t0, c1 - c0, ()

    def stats(self) -> dict:
        s = self.m.stats()
        return {f: getattr(s, f) for f in type(s).__slots__}

    def close(self) -> None:
        pass


def build_pb(pb, d: StepDesc):
    """A pb.StepRequest built directly, the way the model service's client should: sub-messages
    are filled in place (repeated.add(), field sets). About 2x faster than build_pb_simple,
    which constructs every Need/Grow/Commit and hands lists of them to the constructor, so
    upb copies each one again."""
    req = pb.StepRequest(epoch=EPOCH, releases=d.releases)
    add = req.commits.add
    for s, n, toks in d.commits:
        add(seq_id=s, num_computed=n, token_ids=toks)
    add = req.needs.add
    for s, n in d.grows:
        g = add().grow
        g.seq_id = s
        g.num_tokens = n
    for r, p, mt in d.admits:
        a = add().admit
        a.request_id = r
        a.token_ids.extend(p)
        if mt is not None:
            a.max_tokens = mt
    return req


def build_pb_simple(pb, d: StepDesc):
    """The obvious way to build the same message (for the comparison in --profile)."""
    needs = [pb.Need(grow=pb.Grow(seq_id=s, num_tokens=n)) for s, n in d.grows]
    for r, p, mt in d.admits:
        if mt is None:
            needs.append(pb.Need(admit=pb.Admit(request_id=r, token_ids=p)))
        else:
            needs.append(pb.Need(admit=pb.Admit(request_id=r, token_ids=p, max_tokens=mt)))
    return pb.StepRequest(
        epoch=EPOCH, releases=d.releases,
        commits=[pb.Commit(seq_id=s, num_computed=n, token_ids=toks) for s, n, toks in d.commits],
        needs=needs)


class PbInProcBackend(CoreBackend):
    """What the server does per Step, minus gRPC and the transport: the client builds
    a pb.StepRequest, it is serialized and parsed, convert.step_request_from_pb, the core
    step, convert.step_plan_to_pb, the response serialized and parsed."""
    name = "in-process via protobuf"

    def __init__(self, num_pages: int, max_seqs: int) -> None:
        super().__init__(num_pages, max_seqs)
        from kvserve.kvcache_service.contract import convert
        from kvserve.kvcache.v1 import kvcache_pb2 as pb
        self.pb, self.convert = pb, convert
        self.profilers: dict[str, cProfile.Profile] | None = None

    def build(self, d: StepDesc):
        if self.profilers:
            prof = self.profilers
            prof["client build (simple)"].enable()
            simple = build_pb_simple(self.pb, d)
            prof["client build (simple)"].disable()
            prof["client build"].enable()
            msg = build_pb(self.pb, d)
            prof["client build"].disable()
            assert msg == simple
            return msg
        return build_pb(self.pb, d)

    def step(self, msg):
        pb, convert, m, clock = self.pb, self.convert, self.m, time.perf_counter_ns
        prof = self.profilers or {}
        c0 = time.thread_time_ns()
        t0 = clock()
        wire = msg.SerializeToString()
        req_pb = pb.StepRequest.FromString(wire)
        t1 = clock()
        if prof:
            prof["server convert"].enable()
        req = convert.step_request_from_pb(req_pb)
        if prof:
            prof["server convert"].disable()
        t2 = clock()
        if prof:
            prof["core step"].enable()
        plan = m.step(req)
        if prof:
            prof["core step"].disable()
        t3 = clock()
        if prof:
            prof["server convert"].enable()
        resp = convert.step_plan_to_pb(plan)
        if prof:
            prof["server convert"].disable()
        t4 = clock()
        out = resp.SerializeToString()
        resp2 = pb.StepResponse.FromString(out)
        t5 = clock()
        c1 = time.thread_time_ns()
        # extra: (wire in, decode, core, encode, wire out, request bytes, response bytes)
        return resp2.results, resp2.preempted, t5 - t0, c1 - c0, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4,
                                                          len(wire), len(out))


def free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class GrpcBackend:
    """`kvserve kvcache` in its own process (python -m kvserve.services.cli.main kvcache ...), a sync grpc
    channel in this one: client and server do not share a GIL."""

    def __init__(self, name: str, listen: str, num_pages: int, max_seqs: int, server_profile: str | None,
                 stream: bool = False) -> None:
        import grpc
        from kvserve.kvcache.v1 import kvcache_pb2 as pb
        from kvserve.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
        self.name, self.pb = name, pb
        cmd = [sys.executable]
        if server_profile:  # cProfile writes the stats when the server exits (SIGTERM: a graceful stop)
            cmd += ["-m", "cProfile", "-o", server_profile]
        cmd += ["-m", "kvserve.services.cli.main", "--log-level", "warning", "kvcache", "--listen", listen,
                "--num-pages", str(num_pages), "--max-seqs", str(max_seqs), "--page-size", str(PS)]
        self.proc = subprocess.Popen(cmd)
        opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        self.channel = grpc.insecure_channel(listen, options=opts)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=60)
        except grpc.FutureTimeoutError:
            self.close()
            raise RuntimeError(f"kvserve kvcache did not come up on {listen}") from None
        self.stub = pb_grpc.KVCacheManagerStub(self.channel)
        self.stub.Register(pb.RegisterRequest(epoch=EPOCH, page_size=PS, num_pages=num_pages, instance="bench"))
        if stream:  # what the engine uses: one long-lived StepStream
            from kvserve.kvcache_service.contract.client import _StepStream
            self._stream = _StepStream(self.stub)
            self._step = self._stream.call
        else:
            self._stream = None
            self._step = self.stub.Step

    def build(self, d: StepDesc):
        return build_pb(self.pb, d)

    def step(self, msg):
        t0 = time.perf_counter_ns()
        resp = self._step(msg)
        t1 = time.perf_counter_ns()
        return resp.results, resp.preempted, t1 - t0, 0, ()

    def empty_rtt(self, n: int) -> list[int]:
        msg, step, out = self.pb.StepRequest(epoch=EPOCH), self._step, []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            step(msg)
            out.append(time.perf_counter_ns() - t0)
        return out

    def stats(self) -> dict:
        s = self.stub.GetStats(self.pb.GetStatsRequest())
        return {f.name: getattr(s, f.name) for f in s.DESCRIPTOR.fields}

    def server_cpu_s(self) -> float:
        """CPU seconds the server process has used, all threads (user + system)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


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
