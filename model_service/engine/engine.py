"""The engine loop: one thread owns torch and runs every step.

    manager's plan → swap / copy pages → next proposal out → forward → sample → emit

One Step round trip per step, pipelined: step N+1's proposal is built and sent just
before step N's forward, so the manager works while the model does, and step
N+1 starts with its plan usually there (scheduler.py says how proposals are built
ahead of the tokens they wait for). A proposal that asks the manager nothing (every
sequence decodes inside the pages it holds, no full page to commit, nothing to release)
is not sent: its plan is empty whoever answers it, and skipping it spares the manager
and this process a message each way on most decode steps of a small batch.

Other threads (the asyncio servicer) talk to it only through submit() and
cancel(), which post to an inbox; events go back through each request's sink,
which must not block, so a slow client never stalls a step. After each pass
of the loop the engine calls `on_step_end` (given at construction), so a sink may
hold its events until then and hand over a whole step's at once.

When the manager goes away (its stream breaks, or it stops answering for longer than
manager_timeout_s) the engine stops stepping, puts every request it holds back in the
waiting queue in arrival order, and registers again under a new epoch as soon as a manager
answers (manager_link.py). Each request is then re-admitted from its prompt and the tokens
it has generated so far, recomputed, and goes on streaming where it was: greedy and seeded
requests produce exactly the tokens they would have. A loss longer than manager_timeout_s
ends every request with UNAVAILABLE and refuses new ones until the manager is back.

A Step refused over state the engine does not hold (a sequence the manager no longer knows, a
request id it already has, a sequence in another state: something else changed its tables) is
met the same way, under a new epoch at once; only the same refusal MAX_RESYNCS times in a row,
with no step accepted between, is taken for a fault of the engine's own (INTERNAL).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.kvcache_service.contract.client import KVClient
from kvserve.kvcache_service.contract.errors import (AlreadyExists, FailedPrecondition, InvalidArgument,
                                                     ManagerUnavailable, NotFound)
from kvserve.kvcache_service.contract.types import StepPlan, StepRequest
from kvserve.model_service.engine.errors import (
    DuplicateRequest,
    InternalError,
    InvalidRequest,
    QueueFull,
    RequestFailed,
    Unavailable,
)
from kvserve.model_service.engine.events import Event, Failed, Finished, PrefillDone, PromptLogprobs, Tokens
from kvserve.model_service.engine.family import spawn
from kvserve.model_service.engine.manager_link import ManagerLink
from kvserve.model_service.engine.output import OutputProcessor
from kvserve.model_service.engine.queue_positions import QueuePositions
from kvserve.model_service.engine.request import Request, Status
from kvserve.model_service.engine.runner import ModelRunner
from kvserve.model_service.engine.scheduler import HeldElsewhere, Scheduler, SchedulerConfig, Work
from kvserve.model_service.engine.speculation import NgramDrafter, accepted_prefix
from kvserve.model_service.engine.watchdog import Progress, Watchdog
from kvserve.model_service.sampling.prompt_logprobs import prompt_logprobs
from kvserve.model_service.sampling.sampler import make_generator, seeded_for
from kvserve.model_service.sampling.structured import first_lines

MAX_RESYNCS = 3   # refused Steps in a row, each met by registering again, before it counts as a bug

log = logging.getLogger(__name__)


@dataclass
class EngineCounters:
    steps: int = 0
    manager_steps: int = 0     # steps whose proposal went to the manager (the rest asked it nothing)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0            # ended with an error (the manager lost too long, shutdown, a bug)
    manager_losses: int = 0    # times the manager went away and the engine re-admitted its requests
    preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})
    # --speculative: steps a sequence verified a draft in, draft tokens, and those accepted
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # seconds per phase of the step, since start
    schedule_s: float = 0.0
    manager_s: float = 0.0
    copy_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    emit_s: float = 0.0


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        sampler,
        tokenizer,
        eos_token_ids: frozenset[int],
        kv: KVClient,
        scheduler_config: SchedulerConfig,
        *,
        num_pages: int,
        max_waiting: int = 1024,
        stream_interval: int = 1,
        manager_timeout_s: float = 5.0,
        stall_timeout_s: float = 30.0,
        on_step_end: Callable[[], None] = lambda: None,
        drafter: NgramDrafter | None = None,
        cpu_pages: int | None = None,
    ) -> None:
        self.runner = runner
        self.sampler = sampler
        self.tokenizer = tokenizer            # each request's OutputProcessor detokenizes with it
        self.eos_token_ids = eos_token_ids    # and stops at these (unless ignore_eos)
        self.num_pages = num_pages
        self.max_waiting = max_waiting
        self.stream_interval = stream_interval  # tokens per Tokens event (the first goes alone)
        self.stall_timeout_s = stall_timeout_s
        # A new epoch on every start and every reconnection: the manager drops stale tables.
        self.link = ManagerLink(kv, scheduler_config.page_size, num_pages, manager_timeout_s, cpu_pages=cpu_pages)
        self.counters = EngineCounters()
        self.drafter = drafter
        self.scheduler = Scheduler(scheduler_config, preemptions=self.counters.preemptions, drafter=drafter)
        self.progress = Progress()
        self._positions = QueuePositions()   # tells waiting requests their place
        self._watchdog = Watchdog(self.progress, self.link, lambda: bool(self._live), stall_timeout_s)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, Request] = {}
        self._cancelled: set[str] = set()   # live requests a cancel has reached, not yet ended
        self._lock = threading.Lock()  # guards _live and _cancelled
        self._arrivals = itertools.count()   # each request's place in line, kept through a re-admission
        self._stop = threading.Event()
        self._idle = threading.Event()  # set when a loop pass found nothing to do
        self._thread: threading.Thread | None = None
        self.num_running = self.num_waiting = self.num_swapped = 0   # sequences (n of them a request)
        # Tokens the running sequences have yet to compute before they decode, the step now running included
        # (what a gateway weighs as the prefill ahead of a request it sends here); after the step's
        # forward, without it.
        self.num_prefill_tokens = self._prefill_after_step = 0
        self._running_requests = self._swapped_requests = 0          # requests with a sequence so
        self._in_flight: tuple | None = None  # (proposal, callable giving the manager's plan)
        self._resyncs = 0   # Steps refused in a row over state the engine does not hold
        self.on_step_end = on_step_end  # after each loop pass: the servicer's event relay flushes

    # ------------------------------------------------------ other threads

    @property
    def epoch(self) -> int:
        return self.link.epoch

    @property
    def kv(self) -> KVClient:
        return self.link.kv

    def start(self, timeout_s: float | None = None) -> None:
        """Registers with the manager (waiting up to `timeout_s` for it), then runs the loop.
        Raises the manager's KVCacheError."""
        self.link.register(timeout_s)
        self.scheduler.epoch = self.link.epoch
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._thread.start()
        self._watchdog.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._watchdog.stop()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout_s)

    def submit(self, request: Request, sink: Callable[[Event], None]) -> None:
        """Queues a validated request. Raises QueueFull, DuplicateRequest, or Unavailable while
        the manager has been lost for longer than its timeout."""
        if self.link.long_loss or self.link.superseded_by is not None:
            raise Unavailable(self._why_unavailable())
        with self._lock:
            if request.request_id in self._live:
                raise DuplicateRequest(f"request id {request.request_id!r} is already in flight")
            if self.num_queued() >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are already waiting; try again later")
            # its sink before it is live: a fail-everything pass between the two found no sink to
            # tell, and the stream waited for its deadline
            request.sink = sink
            request.order = next(self._arrivals)
            self._live[request.request_id] = request
        self._inbox.put(("submit", request))

    def cancel(self, request_id: str, request: Request | None = None) -> bool:
        """Aborts a live request (its pages go within one step). False if unknown, or, with
        `request`, if the id is live as another request: its own call's late cancel (the client
        gone, it ended meanwhile) must not abort one sent again under the same id."""
        with self._lock:
            live = self._live.get(request_id)
            if live is None or (request is not None and live is not request):
                return False
            request = live
            self._cancelled.add(request_id)
        # the request itself, not its id: a cancel still in the inbox when its request ends must
        # not abort a request sent again under the same id after it
        self._inbox.put(("cancel", request))
        return True

    def ending(self, request_id: str) -> bool:
        """The request is cancelled and on its way out (within a step): its id is free soon."""
        with self._lock:
            return request_id in self._cancelled

    def end_all(self, error: RequestFailed) -> None:
        """Ends every request in flight with `error` (a drain past its grace period), within a
        moment even while the engine waits on a manager that does not answer."""
        self._inbox.put(("end_all", error))
        self.link.hurry()

    def num_live(self) -> int:
        """Requests submitted and not yet ended."""
        return len(self._live)

    def num_queued(self) -> int:
        """Live requests with no sequence running as of the last step: waiting, swapped out, and
        those submitted since (counted the moment submit() takes them, before any step sees
        them). What --max-waiting bounds. (Requests, not sequences: a running request of n = 4
        hid three waiting ones.)"""
        return max(0, len(self._live) - self._running_requests)

    def num_waiting_requests(self) -> int:
        """Queued requests none of whose sequences is swapped out: what a report of this worker's
        load counts as waiting."""
        return max(0, self.num_queued() - self._swapped_requests)

    def problem(self) -> str | None:
        """Why this engine cannot make progress now (for readiness), or None."""
        if self.link.superseded_by is not None or self.link.lost_since is not None:
            return self._why_unavailable()
        quiet = self.link.quiet_for()
        if quiet is not None and quiet >= self.link.timeout_s:   # idle: found by the watchdog's probes
            return (f"its KV-cache manager has not answered for {quiet:.0f} s; "
                    "this worker cannot serve until it does")
        return self._stall()

    def stalled(self) -> str | None:
        """Why the engine is stuck on its own, not waiting for its manager (for liveness: a
        restart may help), or None. A wait for the manager is bounded by --manager-timeout."""
        if self.link.lost_since is not None or self.progress.on_manager:
            return None
        return self._stall()

    def _stall(self) -> str | None:
        stalled = self.progress.stalled_for(bool(self._live), self.stall_timeout_s)
        if stalled is not None:
            return f"the engine has computed nothing for {stalled:.0f} s; it is {self.progress.doing()}"
        return None

    def wait_idle(self, timeout_s: float) -> bool:
        """Blocks until the engine has nothing left to do (finished requests'
        pages released included). For tests and orderly shutdown."""
        self._idle.clear()
        self._inbox.put(("wake", None))
        return self._idle.wait(timeout_s)

    # ------------------------------------------------------- engine thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.link.lost:
                try:
                    self._while_lost()
                except Exception:   # a bug: the thread must not die with requests waiting on it
                    self._internal_error("waiting for the KV-cache manager failed")
                continue
            self._take_inbox(block=not self._has_work())
            if self._has_work():
                self._idle.clear()
                try:
                    self._step()
                except ManagerUnavailable as exc:
                    self._lose_manager(exc)
                except FailedPrecondition as exc:   # our epoch is not the manager's, or a state is not
                    if self.link.restarted_elsewhere():
                        self._lose_manager(exc)
                    else:
                        self._diverged(exc)
                except (NotFound, AlreadyExists, InvalidArgument, HeldElsewhere) as exc:   # the manager's
                    self._diverged(exc)                           # tables are no longer ours (truncated)
                except Exception:
                    self._internal_error("the engine step failed")
            else:
                self.progress.advanced()
                self.progress.enter("idle")
            self.on_step_end()
            if not self._has_work():
                self._idle.set()
        self._fail_all(Unavailable("the server shut down before the request finished"))
        self.on_step_end()

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, value = item
            if kind == "submit":
                if value.status is not Status.FINISHED:   # not ended while it sat in the inbox
                    self._admit(value)
            elif kind == "cancel":
                if self._live.get(value.request_id) is value:
                    for member in _members(value):
                        if member.status is not Status.FINISHED:
                            self._finish(member, "abort")
            elif kind == "end_all":
                self._fail_all(value)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, request: Request) -> None:
        """Into the waiting queue; with n > 1, its children wait to fork from it (family.py)."""
        if request.output is None:   # a continued request brings its own, primed
            request.output = OutputProcessor(request, self.tokenizer, self.eos_token_ids)
        request.queued_at_step = self.counters.steps
        self.scheduler.add(request)
        if request.params.n > 1:
            device = self.runner.device
            family = spawn(request, request.params.n, lambda seed: make_generator(seed, device))
            for child in family.members[1:]:
                child.sink = request.sink
                child.output = OutputProcessor(child, self.tokenizer, self.eos_token_ids)
                if child not in family.unforked:   # a one-token prompt: nothing to share
                    self.scheduler.add(child)

    # ------------------------------------------------------- the manager lost

    def _lose_manager(self, error: Exception) -> None:
        """Every request waits again, in arrival order, until a manager takes a new epoch."""
        self.link.lose()
        self._drop_in_flight()
        held = self.scheduler.requeue_all()
        self._count()
        self.counters.manager_losses += 1
        log.warning("lost the KV-cache manager at %s (%s); %d requests wait for it to come back", self.link.kv.address,
                    error, held)

    def _diverged(self, error: Exception) -> None:
        """The manager refused a Step over state this engine does not hold. Every request is
        re-admitted under a new epoch (which drops whatever the manager held), as after a loss."""
        self._resyncs += 1
        if self._resyncs > MAX_RESYNCS:
            self._resyncs = 0
            self._internal_error(f"a Step the manager refused {MAX_RESYNCS + 1} times in a row")
            return
        log.warning("the KV-cache manager refused a Step over state this engine does not hold (%s): "
                    "something else changed its tables; registering again", error)
        self._lose_manager(error)

    def _while_lost(self) -> None:
        self.progress.enter("waiting for the KV-cache manager", on_manager=True)
        self._take_inbox(block=False)   # cancels, and new requests while the loss is short
        if self.link.superseded_by is None and self.link.reconnect():
            self.scheduler.epoch = self.link.epoch
            log.info("the KV-cache manager at %s is back (epoch %d); re-admitting %d requests",
                     self.link.kv.address, self.link.epoch, len(self.scheduler.waiting))
            self.progress.advanced()
        elif self.link.loss_is_long() or self.link.superseded_by is not None or (self.link.long_loss and self._live):
            # (the last: a request submit() took as the loss turned long, which nothing else would end)
            self._fail_all(Unavailable(self._why_unavailable()))
        if self.link.superseded_by is not None:
            self._stop.wait(0.5)   # nothing more to try; the inbox is read for cancels
        self.on_step_end()

    def _why_unavailable(self) -> str:
        """What clients and the health checks read: the manager's address is the log's alone
        (a tenant reads this, and at a gateway its workers' words reach every client)."""
        if self.link.superseded_by is not None:
            return "this model service no longer serves: another one registered with its KV-cache manager"
        if self.link.refusal:   # (why its manager refused it)
            return f"{self.link.refusal}; this worker cannot serve until a manager that takes it is there"
        lost = self.link.lost_since
        for_how_long = f" for {time.monotonic() - lost:.0f} s" if lost is not None else ""
        return (f"its KV-cache manager has been unreachable{for_how_long}; "
                f"this worker cannot serve until it is back")

    def _internal_error(self, what: str) -> None:
        """A bug: every request ends with INTERNAL naming an incident id the log has beside the
        traceback; the engine starts clean under a new epoch."""
        error = InternalError(what)
        log.exception("%s (incident %s); ending the %d requests in flight", what, error.incident, len(self._live))
        self._fail_all(error)
        self._drop_in_flight()   # the state may be what the bug broke: start clean, under a new epoch
        old = self.scheduler
        self.scheduler = Scheduler(old.config, preemptions=self.counters.preemptions, drafter=self.drafter)
        self.scheduler.forks, self.scheduler.slid_pages = old.forks, old.slid_pages
        try:
            self.link.register(self.link.timeout_s)
            self.scheduler.epoch = self.link.epoch
        except ManagerUnavailable:
            self.link.lose()
        except Exception:
            log.exception("registering again after incident %s failed", error.incident)
            self.link.lose()

    def _drop_in_flight(self) -> None:
        """Forgets the Step sent ahead, and tells the client so: its answer, still to come on
        the stream, must not be taken for the next Step's."""
        if self._in_flight is not None:
            self._in_flight = None
            self.kv.reset()

    def _has_work(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_work()

    def _propose_next_step(self) -> None:
        c, clock = self.counters, time.perf_counter
        t0 = clock()
        proposal = self.scheduler.build()
        t1 = clock()
        if asks_nothing(proposal.step):
            plan = StepPlan(available_pages=self.scheduler.available_pages)
            self._in_flight = (proposal, lambda: plan)
        else:
            self._in_flight = (proposal, self.kv.send_step(proposal.step))
            c.manager_steps += 1
        c.schedule_s += t1 - t0
        c.manager_s += clock() - t1

    def _step(self) -> None:
        sched, c, clock, progress = self.scheduler, self.counters, time.perf_counter, self.progress
        if self._in_flight is None:  # nothing sent ahead: the first step after idling
            self._propose_next_step()
        (proposal, plan_of), self._in_flight = self._in_flight, None
        progress.enter("waiting for the KV-cache manager's plan", on_manager=True)
        t1 = clock()
        plan = self.link.wait_for_plan(plan_of)
        self._resyncs = 0
        t2 = clock()
        progress.enter("copying pages")
        self.runner.kv_cache.execute(plan)   # the plan's page copies, in the manager's order
        t3 = clock()
        work = sched.apply(proposal, plan)
        while sched.unservable:
            r, why = sched.unservable.pop()
            self._fail(r, InvalidRequest(f"the request cannot go on with this server's KV cache: {why}"))
        c.steps += 1
        if self._positions.tell(sched.waiting, c.steps, sched.first_admitted):
            self.on_step_end()   # "left the queue" out now, not after the forward that may crash on it
        progress.step = c.steps
        self._count(work)
        c.schedule_s += clock() - t3
        c.manager_s += t2 - t1
        c.copy_s += t3 - t2
        if sched.has_work() and not sched.drafts_next(work):
            self._propose_next_step()  # its round trip overlaps this step's forward
        if not work:   # no progress for the requests in flight, however many such steps run
            if self._live:
                progress.empty_steps += 1
            else:
                progress.advanced()
            return
        progress.enter(f"running the model ({len(work)} sequences)")
        t4 = clock()
        logits = self.runner.execute(work)
        self.num_prefill_tokens = self._prefill_after_step
        if any(w.prompt_rows for w in work):
            logits = self._take_prompt_logprobs(logits, work)
        sampled = [w for w in work if w.samples]
        t5 = clock()
        c.forward_s += t5 - t4
        if not sampled:
            progress.advanced()
            return
        progress.enter("sampling")
        if any(w.draft for w in sampled):
            out = self._sample_drafts(logits, sampled)
        else:
            requests = [w.request for w in sampled]
            generators = [None if r.generator is None else seeded_for(r.generator, r.params.seed, r.num_output)
                          for r in requests]
            histories = [r.penalty_history() if r.params.has_penalties else ((), ()) for r in requests]
            out = self.sampler(logits, [r.params for r in requests], [h[0] for h in histories],
                               [h[1] for h in histories], generators, [r.matcher for r in requests],
                               [r.num_output for r in requests])
        t6 = clock()
        progress.enter("streaming")
        row = 0
        for w in sampled:
            r = w.request
            if w.draft:
                self._verify(w, out.token_ids[row:row + 1 + len(w.draft)], out.logprobs[row:row + 1 + len(w.draft)])
                row += 1 + len(w.draft)
            else:
                self._emit(r, out.token_ids[row], out.logprobs[row])
                row += 1
        c.sample_s += t6 - t5
        c.emit_s += clock() - t6
        progress.advanced()

    @staticmethod
    def _take_prompt_logprobs(logits, work: list[Work]):
        """Records the prompt logprobs the step's prompt rows give (runner.execute put each
        item's before its sampled rows) and returns the sampled rows alone."""
        keep, row = [], 0
        for w in work:
            wanted, r = w.prompt_rows, w.request
            if wanted:
                targets = r.tokens[wanted.start + 1:wanted.stop + 1]
                r.prompt_logprobs.extend(prompt_logprobs(logits[row:row + len(wanted)], targets,
                                                         r.params.prompt_logprobs))
                row += len(wanted)
            if w.samples:
                keep.extend(range(row, row + 1 + len(w.draft)))
                row += 1 + len(w.draft)
        return logits[keep]

    def _sample_drafts(self, logits, sampled: list[Work]):
        """Samples every position of a draft as decoding without it would have: that position's
        own seeded draw, penalties over the tokens before it (speculation.py)."""
        params, prompts, outputs, counts, generators, matchers = [], [], [], [], [], []
        for w in sampled:
            r = w.request
            prompt, history = r.penalty_history() if r.params.has_penalties else ((), ())
            for j in range(1 + len(w.draft)):
                params.append(r.params)
                prompts.append(prompt)
                if not r.params.has_penalties:
                    outputs.append(())
                else:
                    outputs.append(history if j == 0 else r.history.output_then(w.draft[:j]))
                counts.append(r.num_output + j)
                matchers.append(r.matcher)   # (a request with a format drafts nothing: j is 0)
                if r.generator is None:
                    generators.append(None)
                    continue
                if j == 0:
                    generator = r.generator
                else:   # one generator per position: each is seeded for its own
                    while len(r.draft_generators) < j:
                        r.draft_generators.append(make_generator(r.params.seed, self.runner.device))
                    generator = r.draft_generators[j - 1]
                generators.append(seeded_for(generator, r.params.seed, r.num_output + j))
        return self.sampler(logits, params, prompts, outputs, generators, matchers, counts)

    def _verify(self, w: Work, tokens: list[int], logprobs: list) -> None:
        """Emits the draft's confirmed prefix and the target's token after it; the rest is
        truncated from the manager at the next step."""
        r, draft = w.request, w.draft
        accepted = accepted_prefix(draft, tokens)
        self.scheduler.verified(w, accepted)
        c = self.counters
        c.spec_drafts += 1
        c.spec_draft_tokens += len(draft)
        c.spec_accepted_tokens += accepted
        self.drafter.verdict(r.draft_state, len(draft), accepted)
        for token, lp in zip(tokens[:accepted + 1], logprobs[:accepted + 1]):
            self._emit(r, token, lp)
            if r.status is Status.FINISHED:
                return

    def _emit(self, r: Request, token: int, logprobs) -> None:
        if r.status is Status.FINISHED:   # a sibling's failure ended it earlier in this step
            return
        now = time.monotonic()
        if r.first_token_at is None:
            r.first_token_at = now
            family = r.family
            if family is None or not family.prefill_sent:   # once per request, whatever its n
                self.counters.prompt_tokens += r.num_prompt
                self.counters.cached_tokens += r.cached_tokens or 0
                r.sink(PrefillDone(r.num_prompt, r.cached_tokens or 0, _prompt_logprobs(r)))
                if family is not None:
                    family.prefill_sent = True
        r.pending = 0
        format_done = False
        if r.matcher is not None:
            try:
                format_done = _format_complete(r, token)
            except InvalidRequest as error:
                self._fail(r, error)
                return
        r.tokens.append(token)
        self.counters.generated_tokens += 1
        text, done, reason, stop = r.output.add(token, format_done)
        r.unsent.append((token, text, logprobs))
        n = r.num_output - r.continued   # this stream's own: its first goes alone, moved or not
        if done:
            self._finish(r, reason, stop)   # sends what is unsent first
        elif n == 1 or len(r.unsent) >= self.stream_interval:   # chunks of the interval after the first
            self._send_tokens(r)

    @staticmethod
    def _send_tokens(r: Request) -> None:
        """One Tokens event for what the request sampled since its last one."""
        unsent, r.unsent = r.unsent, []
        r.sink(Tokens([t for t, _, _ in unsent], "".join(text for _, text, _ in unsent),
                      [lp for _, _, lp in unsent if lp is not None], r.index, time.monotonic()))

    def _finish(self, r: Request, reason: str, stop: str | int | None = None) -> None:
        self.scheduler.finish(r)
        now = time.monotonic()
        ttft = (r.first_token_at - r.arrival) * 1e3 if r.first_token_at else 0.0
        family = r.family
        if family is not None:
            family.live -= 1
            family.aborted |= reason == "abort"
        if family is None or not family.live:   # the request ends with its last sequence
            if reason == "abort" or (family is not None and family.aborted):
                self.counters.aborted += 1
            else:
                self.counters.finished += 1
            with self._lock:
                owner_id = _owner(r).request_id
                self._live.pop(owner_id, None)
                self._cancelled.discard(owner_id)
        if r.unsent:
            self._send_tokens(r)
        queued = ((r.scheduled_at or now) - r.arrival) * 1e3
        r.sink(Finished(reason, r.num_prompt, r.num_output, r.cached_tokens or 0, ttft,
                        (now - r.arrival) * 1e3, stop if isinstance(stop, str) else "",
                        stop if isinstance(stop, int) else None, queued, r.index))

    def _fail(self, r: Request, error: RequestFailed) -> None:
        """Ends one request, every sequence of it, with `error` (its stream ends with the
        error's status); its pages go back in the next step or the one after (Scheduler.finish)."""
        owner = _owner(r)
        with self._lock:
            self._live.pop(owner.request_id, None)
            self._cancelled.discard(owner.request_id)
        for member in _members(owner):
            if member.status is not Status.FINISHED:
                self.scheduler.finish(member)
        owner.sink(Failed(error))
        self.counters.failed += 1

    def _fail_all(self, error: RequestFailed) -> None:
        """Ends every live request with `error`; pages they hold go back (Scheduler.finish)."""
        with self._lock:
            live, self._live = list(self._live.values()), {}
            self._cancelled.clear()
        for r in live:
            for member in _members(r):
                if member.status is not Status.FINISHED:
                    self.scheduler.finish(member)
            r.sink(Failed(error))
        self.counters.failed += len(live)
        self._count()

    def _count(self, work: list = ()) -> None:
        """The running / waiting / swapped figures the servicer reports, and the prefill ahead:
        `work`'s prompt chunks (a decode's one token is not prefill) and what the running
        sequences have left past them."""
        sched = self.scheduler
        self.num_running, self.num_waiting, self.num_swapped = (
            len(sched.running), len(sched.waiting), len(sched.swapped))
        # (a decode the step left out, or a parent at its fork, has one token left: no prefill)
        after = sum(n for r in sched.running if (n := len(r.tokens) - r.num_computed) > 1)
        self._prefill_after_step = after
        self.num_prefill_tokens = after + sum(n for w in work if (n := w.count - len(w.draft)) > 1)
        running = {id(_owner(r)) for r in sched.running}
        self._running_requests = len(running)
        self._swapped_requests = len({id(_owner(r)) for r in sched.swapped} - running)


def _format_complete(r: Request, token: int) -> bool:
    """Takes the token into the request's structured-output matcher: whether the format is now
    complete with nothing that could follow (the request ends, "stop"). InvalidRequest when the
    matcher cannot go on: a format that compiled but that llguidance cannot follow (a limit of
    its lexer met while generating, a regex nothing matches)."""
    matcher = r.matcher
    if not matcher.consume_token(token) or matcher.is_error():
        if r.forget_format is not None:
            r.forget_format()
        raise InvalidRequest(f"the structured output cannot be followed: {first_lines(matcher.get_error())}")
    return matcher.is_stopped()


def _prompt_logprobs(r: Request) -> PromptLogprobs | None:
    """What PrefillDone says of the prompt's logprobs, which sequence 0 took for all."""
    if r.params is None or r.params.prompt_logprobs is None:
        return None
    owner = _owner(r)
    return PromptLogprobs(r.prompt_ids, owner.prompt_logprobs)


def asks_nothing(step: StepRequest) -> bool:
    """True when the manager's answer to `step` is known: no need, commit, release, truncation
    or slide, so its plan grants nothing, moves nothing and changes no page."""
    return not (step.needs or step.commits or step.releases or step.truncations or step.slides)


def _owner(request: Request) -> Request:
    """The request a sequence is of: itself, or its family's parent when it samples n > 1."""
    return request if request.family is None else request.family.parent


def _members(request: Request) -> list[Request]:
    """The sequences of a request: itself, and its children when it samples n > 1."""
    return [request] if request.family is None else request.family.members
