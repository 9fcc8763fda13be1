"""The scheduler: which requests run this step, and how many tokens each. Policy only.

One token budget per step (max_num_batched_tokens) and one cap on running
sequences (max_num_seqs), spent in priority order:
  1. running decodes (one token each, plus a draft to verify with --speculative), oldest first;
  2. running prefills, the next chunk of each (chunked prefill, split-fuse);
  3. children of parallel sampling forking from a parent at its fork point (family.py);
  4. swapped sequences resuming, oldest first (before any new admission);
  5. waiting requests, FCFS; those preempted by recompute wait at the head.
The manager serves the needs in that order and, when pages run out, preempts
from the tail of the running order; apply() turns its plan into the batch.

Pipelined: the engine builds and sends step N+1's proposal while step N computes,
so the manager's round trip hides behind the forward. apply() ends by moving each
request to where step N leaves it (computed through its chunk, one token pending
if it samples), and build() proposes from there. By the time N+1's plan is
applied, step N may have finished some of those requests (a stop, a cancel):
apply() drops their work and gives back what the manager granted them.

Words: the scheduler *proposes* a step (Proposal: the StepRequest it sent and what
each request asked for); the manager answers with its *plan* (StepPlan).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from kvserve.kvcache_service.contract.types import (
    Admit,
    Commit,
    Fork,
    Grow,
    PreemptionMode,
    Resume,
    Slide,
    StepPlan,
    StepRequest,
    Truncation,
)
from kvserve.model_service.engine.request import Request, Status
from kvserve.model_service.engine.speculation import DraftState, NgramDrafter

log = logging.getLogger(__name__)


# Prompt positions a step computes for a request that asked for its prompt's logprobs: each
# keeps a row of logits, float32 and the vocabulary wide, so a chunk of thousands took gigabytes
# beside a step's usual memory, which the GPU's sizing does not measure.
PROMPT_LOGPROBS_CHUNK = 512


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    max_num_seqs: int = 64               # sequences in one forward pass
    max_num_batched_tokens: int = 2048   # tokens in one forward pass: bounds step latency
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    window: int | None = None            # sliding window: pages before a sequence's window leave it
    sinks: int = 0                       # attention sinks: the first tokens stay beside the window
    # a sequence's prefill tokens per step: --long-prefill-token-threshold, and a window's pool bounds it
    max_chunk: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")


@dataclass(slots=True)
class Work:
    """One sequence's share of a forward pass: tokens[start : start + count], whose last
    len(draft) are the draft (speculation.py) rather than the sequence's own."""
    request: Request
    start: int
    count: int
    draft: list[int] = ()
    # Its positions whose logits give a prompt token's logprob not yet taken (position p's give
    # token p + 1's), in order before its sampled row; set by Scheduler.apply, once a step.
    prompt_rows: range = range(0)

    @property
    def samples(self) -> bool:
        """Its last row's logits give the next token (with a draft: every row's, one per position)."""
        return self.start + self.count - len(self.draft) == len(self.request.tokens)


@dataclass(slots=True)
class Ask:
    """One request's part of the step, and the need it sent the manager (None: none needed)."""
    request: Request
    count: int
    need: Grow | Resume | Admit | Fork | None
    draft: list[int] = ()


@dataclass
class Proposal:
    """What build() sent the manager, and what each request asked for: matched with the
    manager's plan by apply()."""
    step: StepRequest
    asks: list[Ask]


class HeldElsewhere(Exception):
    """The manager's seq ids or pages are taken by sequences this engine never had."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, epoch: int = 0, preemptions: dict[str, int] | None = None,
                 drafter: NgramDrafter | None = None) -> None:
        self.config = config
        self.drafter = drafter             # --speculative: proposes drafts for decoding sequences
        self.epoch = epoch
        # requests preempted, by mode; the engine's counters hold the dict, so it outlives a scheduler
        self.preemptions = preemptions if preemptions is not None else {m.name.lower(): 0 for m in PreemptionMode}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []   # running order: admitted or resumed, oldest first
        self.swapped: deque[Request] = deque()
        self._releases: list[int] = []     # seq ids to release in the next step
        # finished requests whose computed pages the manager has not heard of, with their seq ids:
        # the next step commits them (into the prefix cache), the one after releases them
        self._last_commits: list[tuple[Request, int]] = []
        # running requests the manager refused a Grow that could never fit, with its reason: the
        # engine ends them (asked again, the Grow never would fit)
        self.unservable: list[tuple[Request, str]] = []
        self.by_seq: dict[int, Request] = {}
        self.forks = 0                     # children of parallel sampling forked, since start
        self.slid_pages = 0                # pages sequences let go of past their sliding window, since start
        self.unswapped = 0                 # swapped sequences sent back to be recomputed (manager or here), since start
        self.available_pages = 0           # free + evictable pages after the last plan
        self.first_admitted = 0            # requests the last plan took in for the first time

    # ------------------------------------------------------------ requests

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._releases or self._last_commits)

    def finish(self, request: Request) -> None:
        """Done (stopped, length, aborted): its pages go back in the next step (in the one after,
        when the next commits its last pages)."""
        if request.family is not None and request in request.family.unforked:
            request.family.unforked.remove(request)
        if request.status is Status.WAITING:
            if request in self.waiting:   # not when it was ended before the engine took it in
                self.waiting.remove(request)
        elif request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status is Status.SWAPPED:
            self.swapped.remove(request)
        if request.seq_id is not None:
            if request.status is Status.RUNNING and self._computed_untold(request):
                # Ended in a step no proposal was built ahead of (one that may draft next): its
                # last pages are committed first, as a step built ahead would have.
                self._last_commits.append((request, request.seq_id))
            else:
                self._releases.append(request.seq_id)
            del self.by_seq[request.seq_id]
            request.seq_id = None
        request.status = Status.FINISHED

    def _computed_untold(self, r: Request) -> bool:
        """Whether `r` has full pages computed that no commit has told the manager of."""
        ps = self.config.page_size
        return r.told_computed // ps < r.num_computed // ps

    def requeue_all(self) -> int:
        """The manager was lost, and every page with it: each request waits again, in arrival
        order, to be re-admitted from its prompt and the tokens it has generated (recomputed).
        Returns how many wait."""
        held = [*self.running, *self.swapped, *self.waiting]
        for r in held:
            r.forget_pages()
        held.sort(key=lambda r: r.order)
        self.running, self.swapped, self.waiting = [], deque(), deque(held)
        self.by_seq.clear()
        self._releases, self._last_commits = [], []
        return len(held)

    # --------------------------------------------------------------- build

    def build(self) -> Proposal:
        cfg, ps = self.config, self.config.page_size
        needs: list = []
        asks: list[Ask] = []
        budget = cfg.max_num_batched_tokens
        chunk = cfg.max_chunk or budget

        prompt_rows = PROMPT_LOGPROBS_CHUNK   # the step's, for requests taking their prompt's logprobs

        def chunk_of(r: Request) -> int:   # each prompt position's logits are kept (vocab floats each)
            return min(chunk, prompt_rows) if r.wants_prompt_logprobs else chunk

        def took(r: Request, count: int) -> None:
            nonlocal prompt_rows
            if r.wants_prompt_logprobs:
                prompt_rows -= count

        # Parents at their fork point: their children fork in this step (family.py).
        forking = [r for r in self.running if r.fork_at is not None and r.num_computed == r.fork_at]
        # Drafts rejected last step leave the manager first (and every page past the new end).
        truncations = []
        for r in self.running:
            if r.drafts_told:
                truncations.append(Truncation(r.seq_id, r.drafts_told))
                r.drafts_told = 0
                # The manager frees the pages past the told tokens. (It copies a shared last page
                # only when that page is partial and shared or cached: one with a draft slot never is.)
                del r.page_table[-(-r.told_tokens // ps):]

        def ask_slots(r: Request, count: int, draft: list[int] = ()) -> None:
            total = r.num_computed + count
            need = Grow(r.seq_id, total) if total > len(r.page_table) * ps else None
            if need is not None:
                needs.append(need)
            asks.append(Ask(r, count, need, draft))

        drafted: dict[Request, list[int]] = {}
        decoding = [r for r in self.running if r.is_decoding and r.fork_at is None]
        # Drafts are extras: they take only what the step's running work leaves (a token per
        # decode, each prefill's chunk, each family's forks), else the oldest sequences' drafts
        # took the whole budget and younger ones went steps without a token. Nor do they take
        # more pages between them than are free.
        draft_budget = spare_pages = 0
        if self.drafter is not None:   # (a step without speculation pays nothing for it)
            prefills = {r: min(r.compute_end - r.num_computed, chunk_of(r)) for r in self.running if not r.is_decoding}
            draft_budget = (budget - len(decoding) - sum(len(p.family.unforked) + 1 for p in forking)
                            - sum(prefills.values()))
            spare_pages = self.available_pages - sum(_new_pages(r, r.num_tokens, ps) for r in decoding) - sum(
                _new_pages(r, r.num_computed + count, ps) for r, count in prefills.items())
        for r in decoding:  # decodes first ...
            if not budget:
                break
            draft = self._draft(r, min(budget - 1, draft_budget), spare_pages)
            if draft:
                drafted[r] = draft
                draft_budget -= len(draft)
                spare_pages -= _new_pages(r, r.num_tokens + len(draft), ps) - _new_pages(r, r.num_tokens, ps)
            budget -= 1 + len(draft)
            ask_slots(r, 1 + len(draft), draft)

        slides = self._slides()
        commits = []
        for r in self.running:
            # New full pages are worth committing; a fork reads the parent's computed count; a draft
            # is told as tokens beyond the computed count (so none enters the prefix tree); a slide
            # releases computed pages only.
            draft = drafted.get(r)
            if (draft or r.told_computed // ps < r.num_computed // ps
                    or (r in forking and r.told_computed != r.num_computed) or r.slid_to * ps > r.told_computed):
                commits.append(Commit(r.seq_id, r.num_computed, r.tokens[r.told_tokens:] + (draft or [])))
                r.told_computed, r.told_tokens = r.num_computed, len(r.tokens)
                r.drafts_told = len(draft or ())

        seqs = len(self.running)
        for parent in forking:  # each child computes the last prompt token in a slot of its own
            for child in list(parent.family.unforked):
                if budget and seqs < cfg.max_num_seqs:
                    budget, seqs = budget - 1, seqs + 1
                    needs.append(need := Fork(parent.seq_id, child.request_id, parent.fork_at + 1))
                    asks.append(Ask(child, 1, need))
                else:   # no room in this step: waiting for it could hold the parent forever
                    self._alone(child)
            if budget:   # and the parent, which goes on once no child is left unforked
                budget -= 1
                ask_slots(parent, 1)
        # ... then the next chunk of each prefill (after the forks: a family at its fork point is
        # an older request's decode, and a long prompt's chunks behind it took every step's budget)
        for r in self.running:
            if not r.is_decoding and budget:
                if r.wants_prompt_logprobs and not prompt_rows:   # the step's rows for them are taken
                    continue
                count = min(r.compute_end - r.num_computed, budget, chunk_of(r))
                budget -= count
                took(r, count)
                ask_slots(r, count)
        for r in self.swapped:  # resume before admitting anyone new
            if not budget or seqs >= cfg.max_num_seqs:
                break
            if r.wants_prompt_logprobs and not prompt_rows:
                break
            count = min(r.compute_end - r.num_computed, budget, chunk_of(r))
            took(r, count)
            budget, seqs = budget - count, seqs + 1
            needs.append(need := Resume(r.seq_id, r.num_computed + count))
            asks.append(Ask(r, count, need))
        ending = {r.request_id for r, _ in self._last_commits}   # the manager holds their ids one step more
        for r in self.waiting:
            if not budget or seqs >= cfg.max_num_seqs or r.request_id in ending:   # (an id sent again)
                break
            if r.wants_prompt_logprobs and not prompt_rows:
                break
            count = min(r.compute_end, budget, chunk_of(r))  # an upper bound: cached tokens cost nothing
            took(r, count)
            budget, seqs = budget - count, seqs + 1
            needs.append(need := Admit(r.request_id, r.tokens, r.extra_key, max_tokens=count,
                                       skip_prefix_hits=r.wants_prompt_logprobs))
            asks.append(Ask(r, count, need))

        released_next = []
        for r, seq_id in self._last_commits:   # finished: its rejected draft goes, its pages are told
            if r.drafts_told:
                truncations.append(Truncation(seq_id, r.drafts_told))
                r.drafts_told = 0
            commits.append(Commit(seq_id, r.num_computed, r.tokens[r.told_tokens:]))
            slide = self._slide(r, seq_id)   # with its commit, as the step built ahead would have sent it
            if slide is not None:
                slides.append(slide)
            released_next.append(seq_id)
        self._last_commits = []
        step = StepRequest(self.epoch, self._releases, truncations, commits, needs, cfg.preemption_mode, slides)
        self._releases = released_next
        return Proposal(step, asks)

    def _slides(self) -> list[Slide]:
        """Sliding window: each running sequence's pages wholly before its next queries' window
        (a query at p sees keys p-W+1 .. p; the next step's first query is at num_computed) go
        back to the manager, but the sinks'. The engine's table keeps their ids: attention
        masks them, so whatever another sequence writes there later is never read."""
        if self.config.window is None:
            return []
        return [s for s in (self._slide(r, r.seq_id) for r in self.running) if s is not None]

    def _slide(self, r: Request, seq_id: int) -> Slide | None:
        """The Slide of `r`'s pages now before its window, if any (a sliding window)."""
        window, ps = self.config.window, self.config.page_size
        if window is None:
            return None
        end = max(0, r.num_computed - window + 1) // ps
        first = max(-(-self.config.sinks // ps), r.slid_to)
        if end <= first:
            return None
        self.slid_pages += end - first
        r.slid_to = end
        return Slide(seq_id, first, end)

    def _draft(self, r: Request, budget: int, spare_pages: int) -> list[int]:
        """A draft for a decoding sequence to verify in this step, or []: none with speculation off,
        while its last token is still being sampled (a proposal built ahead), while it backs off.
        `spare_pages`: the free pages the step's other work and earlier drafts leave."""
        drafter = self.drafter
        if drafter is None or r.matcher is not None:   # a format's mask is per position: no drafts to verify
            return []
        if r.draft_state is None:
            r.draft_state = DraftState()
        if r.pending or not drafter.wants(r.draft_state):
            drafter.wait(r.draft_state)
            return []
        # It emits up to 1 + len(draft) tokens; and a draft never preempts anybody: it takes at most
        # the slots its pages have left and `spare_pages`.
        ps = self.config.page_size
        own = max(len(r.page_table), -(-r.num_tokens // ps))   # with the page its decode token may need
        spare = own * ps - r.num_tokens + max(0, spare_pages) * ps
        room = min(budget, r.max_tokens - r.num_output - 1, spare)
        return drafter.propose(r.draft_state, r.tokens, room)

    def drafts_next(self, work: list[Work]) -> bool:
        """Whether a request of this step drafts in the next: then the next proposal waits for this
        step's tokens (a draft follows them) instead of being built ahead."""
        drafter = self.drafter
        return drafter is not None and any(
            w.samples and w.request.fork_at is None and w.request.matcher is None
            and drafter.wants(w.request.draft_state) for w in work)

    @staticmethod
    def verified(w: Work, accepted: int) -> None:
        """A draft's verdict, before its tokens are appended: `accepted` of its tokens hold (their
        K/V too); the manager holds them already, and the rest leave it at the next step."""
        r = w.request
        r.num_computed = w.start + 1 + accepted
        r.told_tokens += accepted
        r.drafts_told -= accepted

    # --------------------------------------------------------------- apply

    def apply(self, proposal: Proposal, plan: StepPlan) -> list[Work]:
        """Takes the manager's plan for `proposal`; returns the step's work, decodes first, each
        request already moved to where the step leaves it (the next proposal starts there)."""
        results = iter(plan.results)
        work: list[Work] = []
        refused = ""   # why an admission was not granted
        resume_refused = False
        self.available_pages = plan.available_pages
        self.first_admitted = 0
        recomputed = {p.seq_id for p in plan.preempted if p.mode is PreemptionMode.RECOMPUTE}
        preempted = {p.seq_id for p in plan.preempted}
        if recomputed:   # the manager freed these; a release of ours would hit a freed (or reused) id
            self._releases = [s for s in self._releases if s not in recomputed]
        for ask in proposal.asks:
            r = ask.request
            result = next(results) if ask.need is not None else None
            if r.status is Status.FINISHED:   # ended after this proposal was built
                if type(ask.need) in (Admit, Fork) and result.granted and result.seq_id not in recomputed:
                    self._releases.append(result.seq_id)   # admitted for nobody: give it back
                continue   # a grown or resumed sequence's release is already queued (finish)
            if result is None:
                work.append(Work(r, r.num_computed, ask.count, ask.draft))
                continue
            if not result.granted:
                if type(ask.need) is Fork:   # no pages for it: forks never preempt, and the parent
                    self._alone(r)           # must not wait for pages other parents may hold
                elif r.status is Status.WAITING:
                    refused = refused or result.reason
                elif r.status is Status.SWAPPED:
                    resume_refused = True
                elif r.seq_id not in preempted:   # a Grow that could never fit: asked again, it never would
                    self.unservable.append((r, result.reason))
                continue
            if type(ask.need) is Fork:
                self._forked(r, result, ask.need.num_tokens - 1)
                work.append(Work(r, r.num_computed, 1))
            elif r.status is Status.RUNNING:  # grow
                r.page_table.extend(result.page_ids)
                work.append(Work(r, r.num_computed, ask.count, ask.draft))
            elif r.status is Status.SWAPPED:  # resume: the whole table comes back
                r.page_table = list(result.page_ids)
                self.swapped.remove(r)
                self._start(r)
                if ask.count:
                    work.append(Work(r, r.num_computed, ask.count))
            else:  # admission
                r.seq_id = result.seq_id
                r.page_table = list(result.page_ids)
                r.num_computed = r.told_computed = result.cached_tokens
                r.told_tokens = len(r.tokens)
                if r.cached_tokens is None:   # the prompt's share: a continuation's tokens are admitted too
                    r.cached_tokens = min(result.cached_tokens, r.num_prompt)
                    r.scheduled_at = time.monotonic()
                    self.first_admitted += 1
                self.waiting.remove(r)
                self.by_seq[r.seq_id] = r
                self._start(r)
                count = min(result.num_tokens, r.compute_end - result.cached_tokens)  # a parent stops at its fork
                if count > 0:
                    work.append(Work(r, result.cached_tokens, count))
        # (A step that preempted closes the manager's queue: a resume refused then says nothing of room.)
        if resume_refused and not plan.preempted and not self.running and not self._releases \
                and not self._last_commits and len(self.swapped) > 1:
            self._unswap_behind_the_head()
        if refused and not self.by_seq and not self._releases and not self._last_commits:
            # Every seq id and page there is free or cached as far as this engine goes, and still
            # none for a request: another client of the manager's API holds them.
            raise HeldElsewhere(f"the KV-cache manager refused an admission ({refused}) while it holds no "
                                "sequence of this engine's")
        # A parent computes its last prompt token only in a step that forked its last child.
        work = [w for w in work if w.request.fork_at is None or w.start < w.request.fork_at
                or self._fork_done(w.request)]
        if plan.preempted:
            gone = self._preempt(plan)
            work = [w for w in work if w.request not in gone]
        # Decodes first, longest context first (the torch backend then attends them in length
        # groups that are row ranges; the cpu kernel's dynamic schedule starts the longest
        # first); the rest in the order proposed.
        work.sort(key=lambda w: -w.request.num_tokens if w.request.is_decoding and not w.draft else 1)
        for w in work:   # where this step leaves each request, before it computes (pipelined)
            r = w.request
            if r.wants_prompt_logprobs:   # a position computed again (recomputed) is not taken twice
                w.prompt_rows = range(max(w.start, len(r.prompt_logprobs)), min(w.start + w.count, r.num_prompt - 1))
            r.num_computed = w.start + w.count
            r.pending = 1 if w.samples else 0
        return work

    def _unswap_behind_the_head(self) -> None:
        """Nothing runs, nothing is being released, and the head of the swapped queue cannot come
        back: the device pages it needs are held by swapped sequences behind it (pages they share
        stay on the device when swapped: a prefix they have in common), and only running
        sequences ever free pages. Those behind the head give theirs back and wait to be
        recomputed, in their order, ahead of new requests; the head resumes at the next step."""
        behind = list(self.swapped)[1:]
        log.warning("swap preemption: the head of the swapped queue (%r) cannot come back while %d swapped "
                    "sequences behind it hold device pages and nothing runs; they go back to be recomputed",
                    self.swapped[0].request_id, len(behind))
        for r in behind:
            self.swapped.remove(r)
            self._releases.append(r.seq_id)
            del self.by_seq[r.seq_id]
            r.forget_pages()
            self.preemptions["recompute"] += 1
        self.waiting.extendleft(reversed(behind))
        self.unswapped += len(behind)

    def _forked(self, child: Request, result, num_computed: int) -> None:
        parent = child.family.parent
        child.family.unforked.remove(child)
        child.seq_id = result.seq_id
        child.page_table = list(result.page_ids)
        child.num_computed = child.told_computed = num_computed
        child.told_tokens = len(child.tokens)   # the manager's child holds the parent's tokens: the prompt
        child.cached_tokens, child.scheduled_at = parent.cached_tokens, parent.scheduled_at
        child.slid_to = parent.slid_to
        self.by_seq[child.seq_id] = child
        self._start(child)
        self.forks += 1

    def _alone(self, child: Request) -> None:
        """A child that could not fork is admitted as a request of its own: it finds the prompt's
        full pages in the prefix cache (the parent committed them) and computes the rest. Its
        request's cached tokens are its parent's, as a forked child's are (what it finds of its
        sibling's pages is no prefix hit of the request's)."""
        parent = child.family.parent
        child.cached_tokens, child.scheduled_at = parent.cached_tokens, parent.scheduled_at
        child.family.unforked.remove(child)
        self.waiting.appendleft(child)

    @staticmethod
    def _fork_done(parent: Request) -> bool:
        if parent.family.unforked:
            return False
        parent.fork_at = None
        return True

    def _start(self, r: Request) -> None:
        r.status = Status.RUNNING
        self.running.append(r)

    def _preempt(self, plan: StepPlan) -> set[Request]:
        gone = set()
        for p in plan.preempted:  # lowest priority first, so the last lands at the head
            r = self.by_seq.get(p.seq_id)
            if r is None:  # admitted and preempted within this step: it never left waiting
                continue
            gone.add(r)
            self.preemptions[p.mode.name.lower()] += 1
            (self.running if r.status is Status.RUNNING else self.swapped).remove(r)
            if p.mode is PreemptionMode.SWAP:
                r.status = Status.SWAPPED
                self.swapped.appendleft(r)
            else:
                if r.status is Status.SWAPPED:   # its device pages went to a Grow (the manager's Step)
                    self.unswapped += 1
                del self.by_seq[p.seq_id]
                r.forget_pages()
                self.waiting.appendleft(r)
        return gone


def _new_pages(r: Request, end: int, page_size: int) -> int:
    """Pages `r` must be granted to hold tokens up to `end`."""
    return max(0, -(-end // page_size) - len(r.page_table))
