"""`kvserve up --metrics-listen`: the whole stack's series at one address. Each child serves its
own on a private port; at each scrape this collector fetches them and serves them together, with
a `worker` label on a worker's series when there are several.
"""

from __future__ import annotations

import logging
import urllib.request

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 2.0


class StackMetrics:
    def __init__(self) -> None:
        self.sources: list[tuple[dict[str, str], str]] = []   # (labels to add, the child's metrics URL)

    def add(self, address: str, **labels: str) -> None:
        self.sources.append((labels, f"http://{address}/metrics"))

    def describe(self):
        return []

    def collect(self):
        families: dict[str, Metric] = {}
        for labels, url in self.sources:
            try:
                with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:
                    text = response.read().decode()
            except OSError as exc:   # a child restarting: its series sit this scrape out
                log.debug("metrics from %s: %s", url, exc)
                continue
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                merged.samples.extend(Sample(s.name, {**labels, **s.labels}, s.value, s.timestamp, s.exemplar)
                                      for s in family.samples)
        yield from families.values()
