"""The manager's Prometheus series: its pages (free / used / cached), evictions, preemptions and
how long a Step takes it. Pool state is read on the server's loop, where the core lives (it has
no lock), when Prometheus scrapes."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvserve.kvcache_service.core.manager import KVCacheManager
from kvserve.services.plumbing.metrics_server import add_process_series, read_on_loop

# Seconds: a Step is tens of microseconds idle, milliseconds for a large batch.
STEP_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class ManagerMetrics:
    def __init__(self, manager: KVCacheManager, loop: asyncio.AbstractEventLoop) -> None:
        self.registry = CollectorRegistry()
        add_process_series(self.registry)
        self.step_seconds = Histogram("kvserve:kv_step_seconds", "Time the manager takes to answer one Step",
                                      buckets=STEP_BUCKETS, registry=self.registry)
        # A dead model service's sequences stay (a live one that reconnects keeps its epoch and
        # needs them) until a new epoch registers: with this at 0, its pages are a dead one's.
        self.step_streams = Gauge("kvserve:kv_step_streams", "StepStream calls open: the model service's "
                                  "link (0: it is gone, or has sent no Step yet; its sequences are held until a "
                                  "new epoch registers)", registry=self.registry)
        self.registry.register(_PoolState(manager, loop))


class _PoolState:
    def __init__(self, manager: KVCacheManager, loop: asyncio.AbstractEventLoop) -> None:
        self.manager = manager
        self.loop = loop

    def describe(self):
        return []

    def collect(self):
        s = read_on_loop(self.loop, self.manager.stats)
        gauges = (("kv_pages_total", "Device KV pages", s.total_pages),
                  ("kv_pages_free", "Device KV pages holding nothing", s.free_pages),
                  ("kv_pages_used", "Device KV pages held by live sequences", s.used_pages),
                  ("kv_pages_cached", "Device KV pages in the prefix tree, unreferenced, evictable",
                   s.cached_pages),
                  ("kv_cpu_pages_total", "CPU swap pages", s.cpu_total_pages),
                  ("kv_cpu_pages_free", "CPU swap pages free", s.cpu_free_pages),
                  ("kv_sequences", "Live sequences", s.num_sequences),
                  ("kv_sequences_swapped", "Sequences swapped to CPU pages", s.num_swapped),
                  # (its epoch is its registration time in ns: 19 digits, more than a float holds
                  # exactly; in seconds it still tells a restart, and when)
                  ("kv_epoch_seconds", "When the registered model service registered (its epoch), Unix "
                                       "seconds; 0 before any", s.epoch / 1e9))
        for name, text, value in gauges:
            yield GaugeMetricFamily(f"kvserve:{name}", text, value=value)
        yield CounterMetricFamily("kvserve:kv_evictions", "Cached pages evicted to make room", value=s.evictions)
        yield CounterMetricFamily("kvserve:kv_prefix_query_tokens", "Prompt tokens looked up in the prefix tree",
                                  value=s.prefix_query_tokens)
        yield CounterMetricFamily("kvserve:kv_prefix_hit_tokens", "Prompt tokens found in the prefix tree",
                                  value=s.prefix_hit_tokens)
        preemptions = CounterMetricFamily("kvserve:kv_preemptions", "Sequences preempted, by mode", labels=["mode"])
        preemptions.add_metric(["recompute"], s.preemptions_recompute)
        preemptions.add_metric(["swap"], s.preemptions_swap)
        yield preemptions
