"""The model service's Prometheus series, named as vLLM names them under a `kvserve:` prefix.

State (requests running / waiting / swapped, cache usage) and the engine's running totals are read
when Prometheus scrapes, so the engine's step pays nothing for them. Per-request histograms are
observed where a stream's events reach the server's loop (servicer.py): what a client sees.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvserve.model_service.engine.events import Finished
from kvserve.model_service.status import REFUSAL_CODES
from kvserve.services.plumbing.metrics_server import (LATENCY_BUCKETS, PEER_TIMEOUT_S, TOKEN_COUNT_BUCKETS,
                                                      TOKEN_LATENCY_BUCKETS, add_process_series, http_answers)


class ServiceMetrics:
    def __init__(self, engine, kv_stats: Callable[..., object], model: dict[str, str] | None = None) -> None:
        """`model`: what kvserve:model_info says of the served model (its name, dtype, device,
        attention backend, GEMM), as GetModelInfo says it."""
        self.registry = CollectorRegistry()
        add_process_series(self.registry)
        r = self.registry
        if model:   # one series, 1: dashboards join on its labels
            Gauge("kvserve:model_info", "The served model, in its labels; always 1", sorted(model),
                  registry=r).labels(**model).set(1)
        self.ttft = Histogram("kvserve:time_to_first_token_seconds", "Arrival to first token, per request",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvserve:inter_token_latency_seconds", "Time between a request's tokens, per token",
                             buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvserve:e2e_request_latency_seconds", "Arrival to the last token, per request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("kvserve:request_queue_time_seconds", "Arrival to first scheduled, per request",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.prompt = Histogram("kvserve:request_prompt_tokens", "Prompt tokens per request",
                                buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.generation = Histogram("kvserve:request_generation_tokens", "Generated tokens per request",
                                    buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.params_n = Histogram("kvserve:request_params_n", "Sequences sampled per request (n)",
                                  buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.success = Counter("kvserve:request_success", "Requests finished, by why they finished",
                               ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):   # each series there from the start, at 0
            self.success.labels(reason)
        self.refused = Counter("kvserve:request_refused", "Generate calls refused before they ran (bad input, a "
                               "full queue, a draining server, ...), by their gRPC status code", ["code"], registry=r)
        for code in REFUSAL_CODES:
            self.refused.labels(code)
        self.http_answered = http_answers(r)
        r.register(_EngineState(engine, kv_stats))

    def stream(self) -> StreamClock:
        return StreamClock(self)


class StreamClock:
    """One Generate call's timings: the gaps between each sequence's tokens, the first token's
    time from the call's arrival (observed when it comes: a long stream's is not held back until
    its end, nor lost when its client leaves), and, once, the request's end. A request of n
    sequences is one request here as in GetServerStats: its other histograms and its success
    count are observed when its last sequence finishes (under that one's reason; abort if any was
    aborted), its generated tokens summed over them; a request its client left is observed then,
    as far as it went."""

    __slots__ = ("metrics", "arrival", "last", "sequences", "ends", "counted", "generated", "prompt_tokens")

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()    # the call's, before its input is tokenized (the engine's clock)
        self.last: dict[int, float] = {}   # each sequence's last token time (its index)
        self.sequences = 1                 # n, once the request is built
        self.ends: list[Finished] = []
        self.counted = False               # the request's end observed (finished or abandoned)
        self.generated = 0                 # tokens streamed so far, over its sequences
        self.prompt_tokens: int | None = None   # once the request is built

    def tokens(self, events) -> None:
        """Tokens events, timed when the engine sent them: a front end that falls behind and
        takes several at once still sees each gap (one per token after a sequence's first)."""
        last = self.last
        for event in events:
            n = len(event.token_ids)
            if not n:
                continue
            if not self.generated:
                self.metrics.ttft.observe(max(0.0, event.at - self.arrival))
            self.generated += n
            before = last.get(event.index)
            if before is not None:
                gap = max(0.0, event.at - before) / n   # tokens sent together share the wait
                for _ in range(n):
                    self.metrics.itl.observe(gap)
            else:   # the sequence's first event: its first token has no gap, the rest came with it
                for _ in range(n - 1):
                    self.metrics.itl.observe(0.0)
            last[event.index] = event.at

    def finished(self, f: Finished) -> None:
        self.ends.append(f)
        if len(self.ends) < self.sequences:
            return
        self.counted = True
        m, ends = self.metrics, self.ends
        generated = sum(e.completion_tokens for e in ends)
        m.e2e.observe(max(e.total_ms for e in ends) / 1e3)
        m.queue.observe(f.queue_ms / 1e3)
        m.prompt.observe(f.prompt_tokens)
        m.generation.observe(generated)
        m.success.labels("abort" if any(e.reason == "abort" for e in ends) else f.reason).inc()

    def abandoned(self) -> None:
        """The call ended before the request did (the client left, cancelled it or ran out of
        time; its client did not read): the engine aborts it, and nobody reads that Finished. Its
        time, its prompt and the tokens it got count as its end's, as a client saw them: those
        who give up waiting are the latency tail. (Its time in the queue is the engine's, unread.)"""
        if not self.counted:
            self.counted = True
            self.metrics.e2e.observe(max(0.0, time.monotonic() - self.arrival))
            if self.prompt_tokens is not None:
                self.metrics.prompt.observe(self.prompt_tokens)
            self.metrics.generation.observe(self.generated)
            self.metrics.success.labels("abort").inc()


class _EngineState:
    """Read at each scrape: the engine's counts and totals, and the manager's page use."""

    def __init__(self, engine, kv_stats: Callable[..., object]) -> None:
        self.engine = engine
        self.kv_stats = kv_stats

    def describe(self):
        return []   # names known only at collect(); nothing to check at registration

    def collect(self):
        e, c = self.engine, self.engine.counters
        # (running and swapped count sequences, as vLLM counts each of a request's n; waiting counts
        # requests, as a request of n waits whole)
        yield GaugeMetricFamily("kvserve:num_requests_running", "Sequences in the running batch (a request of n "
                                "counts n)", value=e.num_running)
        yield GaugeMetricFamily("kvserve:num_requests_waiting", "Requests waiting to run (submitted ones "
                                "included; a request of n counts once), as GetServerStats counts them",
                                value=e.num_waiting_requests())
        yield GaugeMetricFamily("kvserve:num_requests_swapped", "Sequences swapped to CPU pages", value=e.num_swapped)
        reachable = GaugeMetricFamily("kvserve:manager_reachable", "1 while the KV-cache manager answers")
        try:
            if e.link.lost:
                raise ConnectionError("the engine lost its manager")
            stats = self.kv_stats(timeout_s=PEER_TIMEOUT_S)   # a manager that hangs costs only its series
        except Exception:   # the manager is away: its series are left out of this scrape
            reachable.add_metric([], 0)
        else:
            reachable.add_metric([], 1)
            yield GaugeMetricFamily("kvserve:kv_cache_usage_perc", "Share of KV pages held by live requests "
                                    "(0 to 1)", value=stats.used_pages / max(1, stats.total_pages))
        yield reachable
        yield CounterMetricFamily("kvserve:prompt_tokens", "Prompt tokens admitted", value=c.prompt_tokens)
        yield CounterMetricFamily("kvserve:generation_tokens", "Tokens generated", value=c.generated_tokens)
        yield CounterMetricFamily("kvserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=c.prompt_tokens)
        yield CounterMetricFamily("kvserve:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=c.cached_tokens)
        preemptions = CounterMetricFamily("kvserve:num_preemptions", "Requests preempted, by what they lost",
                                          labels=["mode"])
        for mode, n in c.preemptions.items():
            preemptions.add_metric([mode], n)
        yield preemptions
        yield CounterMetricFamily("kvserve:request_failures", "Requests ended by an error (the manager lost "
                                  "too long, shutdown)", value=c.failed)
        yield CounterMetricFamily("kvserve:manager_losses", "Times the KV-cache manager went away and its "
                                  "requests were re-admitted", value=c.manager_losses)
        yield CounterMetricFamily("kvserve:engine_steps", "Engine iterations", value=c.steps)
        phases = CounterMetricFamily("kvserve:engine_phase_seconds", "Engine thread time by phase of its "
                                     "iterations (schedule, manager, copy, forward, sample, emit), as "
                                     "GetServerStats gives it", labels=["phase"])
        for phase in ("schedule", "manager", "copy", "forward", "sample", "emit"):
            phases.add_metric([phase], getattr(c, f"{phase}_s"))
        yield phases
        yield CounterMetricFamily("kvserve:engine_manager_steps", "Engine iterations that sent the KV-cache "
                                  "manager a Step (the others asked it nothing)", value=c.manager_steps)
        yield CounterMetricFamily("kvserve:spec_decode_num_drafts", "Steps in which a sequence verified a draft "
                                  "(--speculative)", value=c.spec_drafts)
        yield CounterMetricFamily("kvserve:spec_decode_num_draft_tokens", "Draft tokens verified",
                                  value=c.spec_draft_tokens)
        yield CounterMetricFamily("kvserve:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                  value=c.spec_accepted_tokens)
        yield CounterMetricFamily("kvserve:sliding_window_released_pages", "KV pages sequences gave back "
                                  "as they slid past their attention window", value=e.scheduler.slid_pages)
        yield CounterMetricFamily("kvserve:parallel_sampling_forks", "Sequences of n > 1 requests started by "
                                  "forking the prompt's pages", value=e.scheduler.forks)
