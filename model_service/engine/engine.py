"""The engine loop: one thread owns torch and runs every step.

    manager's plan → swap / copy pages → next proposal out → forward → sample → emit

One Step round trip per step, pipelined: step N+1's proposal is built and sent just
before step N's forward, so the manager works while the model does, and step
N+1 starts with its plan usually there (scheduler.py says how proposals are built
ahead of the tokens they wait for).

Other threads (the asyncio servicer) talk to it only through submit() and
cancel(), which post to an inbox; events go back through each request's sink,
which must not block, so a slow client never stalls a step. After each pass
of the loop the engine calls `on_step_end` (given at construction), so a sink may
hold its events until then and hand over a whole step's at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.model_service.engine.events import Event, Failed, Finished, PrefillDone, Tokens
from kvserve.model_service.engine.output import OutputProcessor
from kvserve.kvcache_service.contract.client import KVClient
from kvserve.model_service.engine.request import Request, Status
from kvserve.model_service.engine.runner import ModelRunner
from kvserve.model_service.engine.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More requests wait than max_waiting allows."""


class DuplicateRequest(Exception):
    """A request with this id is already in flight."""


@dataclass
class EngineCounters:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    finished: int = 0
    aborted: int = 0
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
        on_step_end: Callable[[], None] = lambda: None,
    ) -> None:
        self.runner = runner
        self.sampler = sampler
        self.tokenizer = tokenizer            # each request's OutputProcessor detokenizes with it
        self.eos_token_ids = eos_token_ids    # and stops at these (unless ignore_eos)
        self.kv = kv
        self.num_pages = num_pages
        self.max_waiting = max_waiting
        self.stream_interval = stream_interval  # tokens per Tokens event (the first goes alone)
        self.epoch = time.time_ns()  # new on every start: the manager drops stale tables
        self.scheduler = Scheduler(scheduler_config, self.epoch)
        self.counters = EngineCounters()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, Request] = {}
        self._lock = threading.Lock()  # guards _live
        self._stop = threading.Event()
        self._idle = threading.Event()  # set when a loop pass found nothing to do
        self._thread: threading.Thread | None = None
        self.num_running = self.num_waiting = self.num_swapped = 0
        self._in_flight: tuple | None = None  # (proposal, callable giving the manager's plan)
        self.on_step_end = on_step_end  # after each loop pass: the servicer's event relay flushes

    # ------------------------------------------------------ other threads

    def start(self) -> None:
        self.kv.register(self.epoch, self.scheduler.config.page_size, self.num_pages)
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout_s)

    def submit(self, request: Request, sink: Callable[[Event], None]) -> None:
        """Queues a validated request. Raises QueueFull or DuplicateRequest."""
        with self._lock:
            if request.request_id in self._live:
                raise DuplicateRequest(f"request id {request.request_id!r} is already in flight")
            if len(self._live) - self.num_running >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are already waiting; try again later")
            self._live[request.request_id] = request
        request.sink = sink
        self._inbox.put(("submit", request))

    def cancel(self, request_id: str) -> bool:
        """Aborts a live request (its pages go within one step). False if unknown."""
        with self._lock:
            if request_id not in self._live:
                return False
        self._inbox.put(("cancel", request_id))
        return True

    def wait_idle(self, timeout_s: float) -> bool:
        """Blocks until the engine has nothing left to do (finished requests'
        pages released included). For tests and orderly shutdown."""
        self._idle.clear()
        self._inbox.put(("wake", None))
        return self._idle.wait(timeout_s)

    # ------------------------------------------------------- engine thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._take_inbox(block=not self._has_work())
            if self._has_work():
                self._idle.clear()
                try:
                    self._step()
                except Exception as exc:  # a bug or a lost manager: fail everyone, start clean
                    log.exception("engine step failed")
                    self._fail_all(f"internal error in the engine step: {exc}")
                    self._restart()
            self.on_step_end()
            if not self._has_work():
                self._idle.set()
        self._fail_all("the server is shutting down")
        self.on_step_end()

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, value = item
            if kind == "submit":
                value.output = OutputProcessor(value, self.tokenizer, self.eos_token_ids)
                self.scheduler.add(value)
            elif kind == "cancel":
                request = self._live.get(value)
                if request is not None and request.status is not Status.FINISHED:
                    self._finish(request, "abort")
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _has_work(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_work()

    def _propose_next_step(self) -> None:
        c, clock = self.counters, time.perf_counter
        t0 = clock()
        proposal = self.scheduler.build()
        t1 = clock()
        self._in_flight = (proposal, self.kv.send_step(proposal.step))
        c.schedule_s += t1 - t0
        c.manager_s += clock() - t1

    def _step(self) -> None:
        sched, c, clock = self.scheduler, self.counters, time.perf_counter
        if self._in_flight is None:  # nothing sent ahead: the first step after idling
            self._propose_next_step()
        (proposal, plan_of), self._in_flight = self._in_flight, None
        t1 = clock()
        plan = plan_of()
        t2 = clock()
        self.runner.kv_cache.execute(plan)   # the plan's page copies, in the manager's order
        t3 = clock()
        work = sched.apply(proposal, plan)
        c.steps += 1
        self.num_running, self.num_waiting, self.num_swapped = (
            len(sched.running), len(sched.waiting), len(sched.swapped))
        c.schedule_s += clock() - t3
        c.manager_s += t2 - t1
        c.copy_s += t3 - t2
        if sched.has_work():
            self._propose_next_step()  # its round trip overlaps this step's forward
        if not work:
            return
        t4 = clock()
        logits = self.runner.execute(work)
        sampled = [w for w in work if w.samples]
        t5 = clock()
        c.forward_s += t5 - t4
        if not sampled:
            return
        requests = [w.request for w in sampled]
        out = self.sampler(logits, [r.params for r in requests], [r.prompt_ids for r in requests],
                           [r.output_ids for r in requests], [r.generator for r in requests])
        t6 = clock()
        for r, token, logprobs in zip(requests, out.token_ids, out.logprobs):
            self._emit(r, token, logprobs)
        c.sample_s += t6 - t5
        c.emit_s += clock() - t6

    def _emit(self, r: Request, token: int, logprobs) -> None:
        now = time.monotonic()
        if r.first_token_at is None:
            r.first_token_at = now
            self.counters.prompt_tokens += r.num_prompt
            self.counters.cached_tokens += r.cached_tokens or 0
            r.sink(PrefillDone(r.num_prompt, r.cached_tokens or 0))
        r.pending = 0
        r.tokens.append(token)
        self.counters.generated_tokens += 1
        text, done, reason, stop = r.output.add(token)
        r.unsent.append((token, text, logprobs))
        n = r.num_output
        if done:
            self._finish(r, reason, stop)   # sends what is unsent first
        elif n == 1 or n % self.stream_interval == 0:
            self._send_tokens(r)

    @staticmethod
    def _send_tokens(r: Request) -> None:
        """One Tokens event for what the request sampled since its last one."""
        unsent, r.unsent = r.unsent, []
        r.sink(Tokens([t for t, _, _ in unsent], "".join(text for _, text, _ in unsent),
                      [lp for _, _, lp in unsent if lp is not None]))

    def _finish(self, r: Request, reason: str, stop: str | int | None = None) -> None:
        self.scheduler.finish(r)
        now = time.monotonic()
        ttft = (r.first_token_at - r.arrival) * 1e3 if r.first_token_at else 0.0
        if reason == "abort":
            self.counters.aborted += 1
        else:
            self.counters.finished += 1
        with self._lock:
            self._live.pop(r.request_id, None)
        if r.unsent:
            self._send_tokens(r)
        r.sink(Finished(reason, r.num_prompt, r.num_output, r.cached_tokens or 0, ttft,
                        (now - r.arrival) * 1e3, stop if isinstance(stop, str) else "",
                        stop if isinstance(stop, int) else None))

    def _fail_all(self, message: str) -> None:
        with self._lock:
            live, self._live = list(self._live.values()), {}
        for r in live:
            if r.sink is not None:
                r.sink(Failed(message))

    def _restart(self) -> None:
        """A new epoch: the manager drops every stale page table of ours."""
        self.epoch = time.time_ns()
        self._in_flight = None
        self.scheduler = Scheduler(self.scheduler.config, self.epoch)
        try:
            self.kv.register(self.epoch, self.scheduler.config.page_size, self.num_pages)
        except Exception:  # the manager is unreachable; the next step will say so again
            log.exception("re-registering with the KV-cache manager failed")


