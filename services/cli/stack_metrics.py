"""`kvserve up --metrics-listen`: the whole stack's series at one address. Each child serves its
own on a private port; at each scrape this collector fetches them and serves them together, with
a `worker` label on a worker's series when there are several, and a `source` label (the child's
name) on each child's process series (process_*, python_*), which all serve under the same names.
Its own two say what the merge
cannot: whether each child's series came in this scrape (`kvserve:stack_source_up`: a child
restarting or hung is left out, its series gone without a word otherwise), and how often `up`
started each child again (`kvserve:stack_child_restarts_total`: its counters start again from 0).
"""

from __future__ import annotations

import logging
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvserve.services.plumbing.metrics_server import PROCESS_SERIES_PREFIXES, SCRAPE_TIMEOUT_S

log = logging.getLogger(__name__)

# Each child answers within it (a hung manager costs a model service PEER_TIMEOUT_S), and the
# children are asked at once: one that hangs costs only its own series.
FETCH_TIMEOUT_S = SCRAPE_TIMEOUT_S


# The children listen on 127.0.0.1: never through a proxy the environment names.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class StackMetrics:
    def __init__(self) -> None:
        # (labels to add, worker label values to rename, the child's metrics URL, its name)
        self.sources: list[tuple[dict[str, str], dict[str, str], str, str]] = []
        self.children: list[tuple[str, object]] = []   # (name, supervisor.Child): its restarts counted
        self._failing: set[str] = set()   # URLs whose last fetch failed: said once, at warning

    def add(self, address: str, workers: dict[str, str] | None = None, source: str = "", **labels: str) -> None:
        """`workers`: the child names workers in a `worker` label by these keys (the gateway, by
        their private addresses, a temporary directory's); served as the values, the names the
        workers' own series carry, so that the two join and stay across restarts. `source`: the
        child's name in kvserve:stack_source_up (default: its address)."""
        self.sources.append((labels, workers or {}, f"http://{address}/metrics", source or address))

    def count_restarts(self, name: str, child) -> None:
        """`child`'s restarts (its `restarts`) served under `name`."""
        self.children.append((name, child))

    def describe(self):
        return []

    def collect(self):
        families: dict[str, Metric] = {}
        with ThreadPoolExecutor(max(1, len(self.sources)), thread_name_prefix="kvserve-metrics-fetch") as pool:
            texts = list(pool.map(self._fetch, [url for _, _, url, _ in self.sources]))
        up = GaugeMetricFamily("kvserve:stack_source_up", "1 when the child's series came in this scrape (0: it is "
                               "restarting, or does not answer)", labels=["source"])
        for (_, _, _, source), text in zip(self.sources, texts):
            up.add_metric([source], 0 if text is None else 1)
        yield up
        restarts = CounterMetricFamily("kvserve:stack_child_restarts", "Times kvserve up started the child again "
                                       "after it exited (its own counters start again from 0)", labels=["child"])
        for name, child in self.children:
            restarts.add_metric([name], child.restarts)
        yield restarts
        for (labels, workers, _, source), text in zip(self.sources, texts):
            if text is None:
                continue
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                # every child serves its process's series under the same names: told apart by child
                extra = {**labels, "source": source} if family.name.startswith(PROCESS_SERIES_PREFIXES) else labels
                merged.samples.extend(Sample(s.name, _renamed({**extra, **s.labels}, workers), s.value, s.timestamp,
                                             s.exemplar) for s in family.samples)
        yield from families.values()

    def _fetch(self, url: str) -> str | None:
        """The child's series as text; None when it does not answer (restarting, or hung)."""
        try:
            with _OPENER.open(url, timeout=FETCH_TIMEOUT_S) as response:
                text = response.read().decode()
        except OSError as exc:   # its series sit this scrape out
            if url not in self._failing:
                log.warning("metrics from %s left out: %s", url, exc)
            self._failing.add(url)
            return None
        self._failing.discard(url)
        return text


def _renamed(labels: dict[str, str], workers: dict[str, str]) -> dict[str, str]:
    if workers and labels.get("worker") in workers:
        return {**labels, "worker": workers[labels["worker"]]}
    return labels
