"""Scheduler + manager without a model: a fake cache stores token ids in slots.

Every step executes the manager's copies in the documented order, "computes"
by writing each token into its slot, and, whenever a row is sampled, reads the
sequence's whole context back through its page table. Any wrong page (a stale
prefix hit, a lost swap, a bad copy) shows up as a context that differs from
the request's tokens.

The loop is the engine's: pipelined, the next step's proposal is built and answered
before this step "computes", and requests are cancelled at random between steps
(as a closed client does), in flight or not. With families (parallel sampling, n > 1)
children fork from their parent; with a drafter (speculative decoding) sequences verify
drafts that are partly wrong, the step is not pipelined, and the rejected tokens are
truncated from the manager at the next step."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kvcache_service.core import KVCacheManager, ManagerConfig, PreemptionMode
from kvserve.kvcache_service.contract.client import InProcessKVClient
from kvserve.model_service.engine.family import spawn
from kvserve.model_service.engine.request import Request, Status
from kvserve.model_service.engine.scheduler import Scheduler, SchedulerConfig
from kvserve.model_service.engine.speculation import accepted_prefix
from kvserve.model_service.sampling.params import SamplingParams


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


class WrongDrafter:
    """Drafts the true continuation with a wrong token at a random place (or none): every
    acceptance length from 0 to the whole draft happens."""

    def __init__(self, rng: random.Random, k: int = 4) -> None:
        self.rng, self.k = rng, k

    def wants(self, state) -> bool:
        return True

    def wait(self, state) -> None:
        pass

    def propose(self, state, tokens: list[int], room: int) -> list[int]:
        n = min(self.rng.randrange(self.k + 1), room)
        draft, context = [], list(tokens)
        for _ in range(n):
            draft.append(next_token(context))
            context.append(draft[-1])
        if draft and self.rng.random() < 0.6:
            draft[self.rng.randrange(len(draft))] = 50   # never a real token
        return draft


def members(r: Request) -> list[Request]:
    return [r] if r.family is None else r.family.members


def run(requests, *, num_pages, page_size, cpu_pages, mode, max_seqs=8, budget=32, max_steps=5000,
        cancel=(), rng=None, drafter=None, max_chunk=None, arrivals=None):
    """Runs `requests` to the end; those in `cancel` are cancelled at a random step (all of
    their family). Returns the sequences that finished, and the preemptions."""
    manager = KVCacheManager(ManagerConfig(num_pages=num_pages, page_size=page_size,
                                           max_seqs=16, cpu_pages=cpu_pages))
    kv = InProcessKVClient(manager)
    sched = Scheduler(SchedulerConfig(page_size, max_seqs, budget, mode, max_chunk=max_chunk), drafter=drafter)
    cache = FakeCache(num_pages, cpu_pages, page_size)
    for r in requests:
        sched.add(r)
        if r.params is not None and r.params.n > 1:
            for child in spawn(r, r.params.n, lambda seed: None).members[1:]:
                if child not in r.family.unforked:
                    sched.add(child)
    to_cancel = list(cancel)
    done = []
    preemptions = 0
    in_flight = None

    def send_next():
        proposal = sched.build()
        return proposal, kv.send_step(proposal.step)

    for step in range(max_steps):
        for r in (arrivals or {}).get(step, ()):   # a request that comes in while others run
            sched.add(r)
        if to_cancel and rng.random() < 0.2:   # between steps, as the engine takes its inbox
            for r in members(to_cancel.pop(rng.randrange(len(to_cancel)))):
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
        if sched.has_work() and not sched.drafts_next(work):
            in_flight = send_next()   # before this step's tokens exist, as the engine does
        for w in work:
            r = w.request
            written = r.tokens[w.start:w.start + w.count - len(w.draft)] + list(w.draft)
            for pos, token in zip(range(w.start, w.start + w.count), written):
                cache.write(r.page_table, pos, token)
            if not w.samples:
                continue
            context = cache.read(r.page_table, len(r.tokens))
            assert context == r.tokens, f"{r.request_id}: context read back differs"
            new = [next_token(r.tokens + list(w.draft[:j])) for j in range(1 + len(w.draft))]
            if w.draft:
                accepted = accepted_prefix(w.draft, new)
                sched.verified(w, accepted)
                new = new[:accepted + 1]
            r.pending = 0
            for token in new:
                r.tokens.append(token)
                if r.num_output >= r.max_tokens:
                    sched.finish(r)
                    done.append(r)
                    break
    assert not sched.has_work() and in_flight is None, "did not finish"
    s = manager.stats()
    assert (s.used_pages, s.num_sequences, s.free_seq_ids) == (0, 0, 16)
    return done, preemptions


def reference(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens


def make_requests(rng, n, shared_prefixes, families: bool = False):
    out = []
    for i in range(n):
        prefix = rng.choice(shared_prefixes)
        prompt = prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        params = SamplingParams(n=rng.choice([1, 1, 2, 3])) if families else None
        out.append(Request(f"r{i}", prompt, max_tokens=rng.randrange(1, 20), params=params))
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
       cancels=st.integers(0, 4), families=st.booleans(), drafts=st.booleans())
def test_random_workloads(seed, page_size, num_pages, cpu_pages, mode, budget, cancels, families, drafts):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(0, 10))] for _ in range(3)]
    requests = make_requests(rng, 10, prefixes, families)
    # A request must fit the pool on its own, as the model service checks at the door; a family's
    # children need a page each besides the prompt's.
    requests = [r for r in requests if -(-(len(r.prompt_ids) + r.max_tokens) // page_size)
                + (r.params.n - 1 if r.params else 0) * (1 + -(-r.max_tokens // page_size)) <= num_pages]
    expected = {r.request_id: reference(r.prompt_ids, r.max_tokens) for r in requests}
    cancelled = rng.sample(requests, min(cancels, len(requests)))
    done, _ = run(requests, num_pages=num_pages, page_size=page_size, cpu_pages=cpu_pages,
                  mode=mode, budget=budget, cancel=cancelled, rng=rng,
                  drafter=WrongDrafter(rng) if drafts else None)
    for r in done:   # every sequence of a family: the same tokens (next_token is deterministic)
        parent = r.family.parent if r.family is not None else r
        assert r.tokens == expected[parent.request_id], f"{r.request_id}: wrong tokens"
    finished = {(r.family.parent if r.family else r).request_id for r in done}
    assert finished >= {r.request_id for r in requests if r not in cancelled}
    assert all(m.status is Status.FINISHED for r in requests for m in members(r))
    for r in requests:
        if r not in cancelled:
            assert sum(1 for d in done if d in members(r)) == len(members(r))


class RightDrafter(WrongDrafter):
    """Always drafts the true continuation, as prompt lookup does on an edit of code."""

    def propose(self, state, tokens: list[int], room: int) -> list[int]:
        draft, context = [], list(tokens)
        for _ in range(min(self.k, room)):
            draft.append(next_token(context))
            context.append(draft[-1])
        return draft


class StepWatch:
    """Wraps Scheduler.apply: the longest run of steps each running sequence went without a token."""

    def __init__(self, monkeypatch) -> None:
        self.gaps: dict[str, int] = {}
        self.longest: dict[str, int] = {}
        apply = Scheduler.apply

        def watched(sched, proposal, answer):
            work = apply(sched, proposal, answer)
            got = {w.request.request_id for w in work}
            for r in sched.running:
                gap = 0 if r.request_id in got else self.gaps.get(r.request_id, 0) + 1
                self.gaps[r.request_id] = gap
                self.longest[r.request_id] = max(self.longest.get(r.request_id, 0), gap)
            return work
        monkeypatch.setattr(Scheduler, "apply", watched)


def test_drafts_take_only_what_the_running_sequences_leave(monkeypatch):
    """Each decode's draft came out of the budget before the younger sequences' tokens: with
    drafts that are always right, the oldest took a budget of 16 and a younger sequence went 12
    steps without a token. Drafts are extras now."""
    watch = StepWatch(monkeypatch)
    requests = [Request(f"r{i}", [i + 1, i + 2, i + 3], 60, SamplingParams()) for i in range(8)]
    done, _ = run(requests, num_pages=200, page_size=4, cpu_pages=0, mode=PreemptionMode.RECOMPUTE,
                  budget=16, drafter=RightDrafter(random.Random(0)))
    assert len(done) == 8
    assert max(watch.longest.values()) == 0, watch.longest


def test_a_family_at_its_fork_is_not_held_behind_a_younger_long_prefill(monkeypatch):
    """Forks were scheduled after every running prefill: a long prompt admitted after an n = 4
    request took each step's budget, and its children never forked (each was recomputed alone)."""
    forks = []
    build = Scheduler.build

    def counted(sched):
        proposal = build(sched)
        forks.extend(n for n in proposal.step.needs if type(n).__name__ == "Fork")
        return proposal
    monkeypatch.setattr(Scheduler, "build", counted)
    family = Request("family", [1, 2, 3, 4, 5, 6], 4, SamplingParams(n=4, temperature=1.0))
    long = Request("long", [(i * 7) % 40 + 1 for i in range(600)], 2, SamplingParams())
    done, _ = run([family, long], num_pages=400, page_size=4, cpu_pages=0, mode=PreemptionMode.RECOMPUTE,
                  budget=32)
    assert len(done) == 5 and len(forks) == 3


@pytest.mark.parametrize("seed", range(6))
def test_the_drafts_of_a_step_take_only_the_pages_its_other_work_leaves(monkeypatch, seed):
    """Each drafting sequence counted the same free pages, and none counted the pages the step's
    plain decodes and prefills needed: together drafts asked for 6 new pages with 4 free, and
    the manager preempted a sequence for a guess."""
    over = []
    build = Scheduler.build

    def checked(sched):
        free, ps = sched.available_pages, sched.config.page_size
        proposal = build(sched)
        running = [a for a in proposal.asks if a.request.seq_id is not None and a.need is None or
                   type(a.need).__name__ == "Grow"]
        plain = sum(max(0, -(-(a.request.num_computed + a.count - len(a.draft)) // ps) - len(a.request.page_table))
                    for a in running)
        drafted = sum(max(0, -(-(a.request.num_computed + a.count) // ps)
                          - max(len(a.request.page_table), -(-(a.request.num_computed + a.count - len(a.draft)) // ps)))
                      for a in running if a.draft)
        if drafted and plain + drafted > free:
            over.append((drafted, plain, free))
        return proposal
    monkeypatch.setattr(Scheduler, "build", checked)
    rng = random.Random(seed)
    requests = [Request(f"r{i}", [rng.randrange(1, 40) for _ in range(rng.randrange(3, 8))], 40, SamplingParams())
                for i in range(8)]
    done, _ = run(requests, num_pages=rng.randrange(36, 48), page_size=4, cpu_pages=0,
                  mode=PreemptionMode.RECOMPUTE, budget=64, drafter=RightDrafter(random.Random(seed)))
    assert len(done) == 8 and not over, over


def test_a_prompt_whose_logprobs_are_asked_is_computed_in_short_chunks(monkeypatch):
    """Each prompt position computed for prompt logprobs keeps a row of logits the vocabulary
    wide: a chunk of the whole budget took gigabytes at a large vocabulary. The bound is the
    step's, over every request taking them."""
    from kvserve.model_service.engine.scheduler import PROMPT_LOGPROBS_CHUNK

    per_step = []
    build = Scheduler.build

    def watched(sched):
        proposal = build(sched)
        per_step.append(sum(a.count for a in proposal.asks   # prompt positions: their logits are kept
                            if a.request.request_id.startswith("asks") and a.request.num_computed < a.request.num_prompt))
        return proposal
    monkeypatch.setattr(Scheduler, "build", watched)
    asking = [Request(f"asks-{i}", [(i * 7 + j) % 40 + 1 for j in range(1500)], 2, SamplingParams(prompt_logprobs=0))
              for i in range(3)]
    plain = Request("plain", [(i * 11) % 40 + 1 for i in range(1500)], 2, SamplingParams())
    done, _ = run([*asking, plain], num_pages=2000, page_size=4, cpu_pages=0, mode=PreemptionMode.RECOMPUTE,
                  budget=4096)
    assert len(done) == 4 and max(per_step) == PROMPT_LOGPROBS_CHUNK   # the step's, all such requests together


@pytest.mark.parametrize("threshold", [None, 8])
def test_a_long_prefill_leaves_room_for_a_short_prompt_past_its_threshold(monkeypatch, threshold):
    """A long prompt's chunks took every step's budget, so a short request that came in behind it
    waited for the whole prefill; --long-prefill-token-threshold leaves it the rest of the step."""
    first_work: dict[str, int] = {}
    steps = [0]
    apply = Scheduler.apply

    def watched(sched, proposal, answer):
        work = apply(sched, proposal, answer)
        steps[0] += 1
        for w in work:
            first_work.setdefault(w.request.request_id, steps[0])
        return work
    monkeypatch.setattr(Scheduler, "apply", watched)
    long = Request("long", [(i * 7) % 40 + 1 for i in range(400)], 2, SamplingParams())
    short = Request("short", [5, 6, 7], 2, SamplingParams())
    done, _ = run([long], num_pages=400, page_size=4, cpu_pages=0, mode=PreemptionMode.RECOMPUTE, budget=32,
                  max_chunk=threshold, arrivals={2: [short]})
    assert {r.request_id for r in done} == {"long", "short"}
    if threshold is None:   # held behind the whole prefill: 400 tokens at 32 a step
        assert first_work["short"] >= 400 // 32
    else:
        assert first_work["short"] <= 4
