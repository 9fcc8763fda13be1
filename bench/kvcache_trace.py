"""The kvcache bench's workload: a seeded trace of requests with shared prefixes, and the
simulated engine (no torch) that turns it into one Step per iteration, as the model service does."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

PS = 16  # page size (tokens)
VOCAB = 32000
EPOCH = 1

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
