"""The gateway's Prometheus series: per worker what it was sent and what its cache saved, its
state and load as last reported; the queue's length and waits; migrations. Read on the gateway's
loop, where the fleet lives, when Prometheus scrapes."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvserve.model_service.status import REFUSAL_CODES   # the workers' (each there from the start, at 0)
from kvserve.services.gateway.fleet import Fleet
from kvserve.services.gateway.worker import DOWN, NOT_SERVING, SERVING, STARTING
from kvserve.services.plumbing.metrics_server import LATENCY_BUCKETS, add_process_series, http_answers, read_on_loop

STATES = (STARTING, SERVING, NOT_SERVING, DOWN)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        add_process_series(self.registry)
        self.queue_wait = Histogram("kvserve:gateway_queue_wait_seconds", "Time a request waited in the gateway's "
                                    "queue for a worker with room (0 for one that found room at once)", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.http_answered = http_answers(self.registry)

    def follow(self, fleet: Fleet, loop: asyncio.AbstractEventLoop) -> None:
        self.registry.register(_FleetState(fleet, loop))


class _FleetState:
    def __init__(self, fleet: Fleet, loop: asyncio.AbstractEventLoop) -> None:
        self.fleet = fleet
        self.loop = loop

    def describe(self):
        return []

    def _snapshot(self):
        index = self.fleet.index
        outcomes = (dict(self.fleet.ended), dict(self.fleet.refused))
        return len(self.fleet.queue), (self.fleet.migrations, self.fleet.generated_tokens, outcomes), [(w.address, w.state, w.load.running, w.load.waiting, w.requests_routed,
                                        w.prompt_tokens, w.hit_tokens, index.pages_of(w.address))
                                       for w in self.fleet.workers.values()]

    def collect(self):
        queued, (migrations, generated, (ended, refused)), workers = read_on_loop(self.loop, self._snapshot)
        yield GaugeMetricFamily("kvserve:gateway_queue_length", "Requests waiting in the gateway's queue",
                                value=queued)
        state = GaugeMetricFamily("kvserve:gateway_worker_state", "1 for each worker's state", labels=["worker", "state"])
        running = GaugeMetricFamily("kvserve:gateway_worker_requests_running", "Requests running at the worker, "
                                    "as it last reported", labels=["worker"])
        waiting = GaugeMetricFamily("kvserve:gateway_worker_requests_waiting", "Requests waiting at the worker, "
                                    "as it last reported", labels=["worker"])
        pages = GaugeMetricFamily("kvserve:gateway_worker_indexed_pages", "The worker's pages in the gateway's "
                                  "prefix index", labels=["worker"])
        routed = CounterMetricFamily("kvserve:gateway_routed_requests", "Requests sent to the worker",
                                     labels=["worker"])
        prompt = CounterMetricFamily("kvserve:gateway_prompt_tokens", "Prompt tokens of the requests the worker "
                                     "took (prefilled)", labels=["worker"])
        hits = CounterMetricFamily("kvserve:gateway_hit_tokens", "Prompt tokens the worker found in its cache",
                                   labels=["worker"])
        for address, st, run, wait, n, p, h, indexed in workers:
            for s in STATES:
                state.add_metric([address, s], 1 if s == st else 0)
            running.add_metric([address], run)
            waiting.add_metric([address], wait)
            pages.add_metric([address], indexed)
            routed.add_metric([address], n)
            prompt.add_metric([address], p)
            hits.add_metric([address], h)
        yield from (state, running, waiting, pages, routed, prompt, hits)
        yield CounterMetricFamily("kvserve:gateway_migrations", "Streams moved to another worker after theirs "
                                  "failed mid-stream", value=migrations)
        yield CounterMetricFamily("kvserve:gateway_generation_tokens", "Tokens streamed to the gateway's clients",
                                  value=generated)
        outcome = CounterMetricFamily("kvserve:gateway_requests", "The gateway's streams that ran, by how they "
                                      "ended (finished, aborted: cancelled or its client gone, failed)",
                                      labels=["outcome"])
        for name, count in ended.items():
            outcome.add_metric([name], count)
        yield outcome
        refusals = CounterMetricFamily("kvserve:gateway_requests_refused", "Generate calls refused before they ran "
                                       "(bad input, a full queue, draining, ...), by their gRPC status code",
                                       labels=["code"])
        for code in sorted(set(REFUSAL_CODES) | set(refused)):
            refusals.add_metric([code], refused.get(code, 0))
        yield refusals
