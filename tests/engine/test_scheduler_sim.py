"""Scheduler + manager without a model: a fake cache stores token ids in slots.

Every step executes the manager's copies in the documented order, "computes"
by writing each token into its slot, and, whenever a row is sampled, reads the
sequence's whole context back through its page table. Any wrong page (a stale
prefix hit, a lost swap, a bad copy) shows up as a context that differs from
the request's tokens.

The loop is the engine's: pipelined, the next step's proposal is built and answered
before this step "computes", and requests are cancelled at random between steps
(as a closed client does), in flight or not."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kvcache_service.core import KVCacheManager, ManagerConfig, PreemptionMode
from kvserve.kvcache_service.contract.client import InProcessKVClient
from kvserve.model_service.engine.request import Request, Status
from kvserve.model_service.engine.scheduler import Scheduler, SchedulerConfig


class FakeCache:
    def __init__(self, num_pages: int, cpu_pages: int, page_size: int) -> None:
        self.ps = page_size
        self.device = [[None] * page_size for _ in range(num_pages)]
        self.cpu = [[None] * page_size for _ in range(cpu_pages)]

    def execute(self, plan) -> None:
        for src, dst in plan.swap_out:
            self.cpu[dst] = list(self.device[src])
        for src, dst in plan.copies:
            self.device[dst] = list(self.device[src])
        for src, dst in plan.swap_in:
            self.device[dst] = list(self.cpu[src])

    def write(self, table, pos, token) -> None:
        self.device[table[pos // self.ps]][pos % self.ps] = token

    def read(self, table, length) -> list:
        return [self.device[table[p // self.ps]][p % self.ps] for p in range(length)]


def next_token(context: list[int]) -> int:
    return hash(tuple(context)) % 50


def run(requests, *, num_pages, page_size, cpu_pages, mode, max_seqs=8, budget=32, max_steps=5000,
        cancel=(), rng=None):
    """Runs `requests` to the end; those in `cancel` are cancelled at a random step."""
    manager = KVCacheManager(ManagerConfig(num_pages=num_pages, page_size=page_size,
                                           max_seqs=16, cpu_pages=cpu_pages))
    kv = InProcessKVClient(manager)
    sched = Scheduler(SchedulerConfig(page_size, max_seqs, budget, mode))
    cache = FakeCache(num_pages, cpu_pages, page_size)
    for r in requests:
        sched.add(r)
    to_cancel = list(cancel)
    done = []
    preemptions = 0
    in_flight = None

    def send_next():
        proposal = sched.build()
        return proposal, kv.send_step(proposal.step)

    for _ in range(max_steps):
        if to_cancel and rng.random() < 0.2:   # between steps, as the engine takes its inbox
            r = to_cancel.pop(rng.randrange(len(to_cancel)))
            if r.status is not Status.FINISHED:
                sched.finish(r)
        if in_flight is None:
            if not sched.has_work():
                break
            in_flight = send_next()
        (proposal, answer_of), in_flight = in_flight, None
        answer = answer_of()
        preemptions += len(answer.preempted)
        cache.execute(answer)
        work = sched.apply(proposal, answer)
        if sched.has_work():
            in_flight = send_next()   # before this step's tokens exist, as the engine does
        for w in work:
            r = w.request
            for pos in range(w.start, w.start + w.count):
                cache.write(r.page_table, pos, r.tokens[pos])
            if w.samples:
                context = cache.read(r.page_table, len(r.tokens))
                assert context == r.tokens, f"{r.request_id}: context read back differs"
                r.pending = 0
                r.tokens.append(next_token(r.tokens))
                if r.num_output >= r.max_tokens:
                    sched.finish(r)
                    done.append(r)
    assert not sched.has_work() and in_flight is None, "did not finish"
    s = manager.stats()
    assert (s.used_pages, s.num_sequences, s.free_seq_ids) == (0, 0, 16)
    return done, preemptions


def reference(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens


def make_requests(rng, n, shared_prefixes):
    out = []
    for i in range(n):
        prefix = rng.choice(shared_prefixes)
        prompt = prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        out.append(Request(f"r{i}", prompt, max_tokens=rng.randrange(1, 20)))
    return out


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
@pytest.mark.parametrize("num_pages", [12, 40])
def test_every_request_gets_its_reference_tokens(mode, num_pages):
    rng = random.Random(num_pages * 7 + int(mode))
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(0, 14))] for _ in range(3)]
    requests = make_requests(rng, 24, prefixes)
    expected = {r.request_id: reference(r.prompt_ids, r.max_tokens) for r in requests}
    done, preemptions = run(requests, num_pages=num_pages, page_size=4, cpu_pages=16, mode=mode)
    assert {r.request_id: r.tokens for r in done} == expected
    if num_pages == 12:
        assert preemptions > 0  # the small pool really exercised preemption


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), page_size=st.sampled_from([1, 2, 4, 8]),
       num_pages=st.integers(6, 40), cpu_pages=st.integers(0, 20),
       mode=st.sampled_from(list(PreemptionMode)), budget=st.integers(4, 40),
       cancels=st.integers(0, 4))
def test_random_workloads(seed, page_size, num_pages, cpu_pages, mode, budget, cancels):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(0, 10))] for _ in range(3)]
    requests = make_requests(rng, 10, prefixes)
    # A request must fit the pool on its own, as the model service checks at the door.
    requests = [r for r in requests if -(-(len(r.prompt_ids) + r.max_tokens) // page_size) <= num_pages]
    expected = {r.request_id: reference(r.prompt_ids, r.max_tokens) for r in requests}
    cancelled = rng.sample(requests, min(cancels, len(requests)))
    done, _ = run(requests, num_pages=num_pages, page_size=page_size, cpu_pages=cpu_pages,
                  mode=mode, budget=budget, cancel=cancelled, rng=rng)
    finished = {r.request_id: r.tokens for r in done}
    assert finished == {rid: expected[rid] for rid in finished}   # whatever finished is right
    assert set(finished) >= {r.request_id for r in requests if r not in cancelled}
    assert all(r.status is Status.FINISHED for r in requests)
