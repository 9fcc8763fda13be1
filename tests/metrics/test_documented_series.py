"""docs/architecture.md's table of series names every series each server serves, and only
those: operators build dashboards and alerts from it."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.kvcache_service.metrics import ManagerMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def documented() -> dict[str, dict[str, tuple[str, frozenset]]]:
    """{server: {series: (type, label names)}} from the table's rows."""
    out: dict[str, dict[str, tuple[str, frozenset]]] = {}
    server = None
    for line in DOC.read_text().splitlines():
        if m := re.match(r"\| \*\*(model service|manager|gateway)\*\* \|", line):
            server = m.group(1)
            out[server] = {}
        elif server and (m := re.match(r"\| `(kvserve:[a-z0-9_]+)` \| (counter|gauge|histogram) \|([^|]*)\|", line)):
            labels = frozenset(name.strip() for name in m.group(3).split(",") if name.strip())
            out[server][m.group(1)] = (m.group(2), labels)
        elif server and not line.startswith("|"):
            break
    return out


def series(text: str) -> dict[str, tuple[str, frozenset]]:
    """{series: (type, label names)} from an exposition (a counter named as scraped, with _total;
    a histogram's `le` is its own)."""
    out = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = frozenset(label for sample in family.samples for label in sample.labels if label != "le")
        out[name] = (family.type, labels if family.samples else None)   # (None: no sample to tell)
    return out


def assert_as_documented(served: dict, table: dict) -> None:
    assert {name: kind for name, (kind, _) in served.items()} == {name: kind for name, (kind, _) in table.items()}
    for name, (_, labels) in served.items():
        assert labels is None or labels == table[name][1], (name, sorted(labels), sorted(table[name][1]))


def scraped(address: str) -> dict:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return series(response.read().decode())


def test_the_table_has_each_server():
    assert set(documented()) == {"model service", "manager", "gateway"}


def check_each_server(fleet) -> None:
    """A fleet of one worker, all serving metrics: each server's series are the table's
    (test_gateway_metrics.py runs it on its fleet, which costs its start once)."""
    table = documented()
    worker = fleet.workers[0]
    assert_as_documented(scraped(worker.model.servicer.metrics_endpoint.address), table["model service"])
    assert_as_documented(scraped(fleet.gateway.gateway.metrics_endpoint.address), table["gateway"])
    manager = ManagerMetrics(worker.manager.manager, worker.manager.loop)
    assert_as_documented(series(generate_latest(manager.registry).decode()), table["manager"])
