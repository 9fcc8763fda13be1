"""docs/architecture.md's table of series names every series each server serves, and only
those: operators build dashboards and alerts from it."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.kvcache_service.metrics import ManagerMetrics
from kvserve.services.plumbing.metrics_server import PROCESS_SERIES_PREFIXES

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
        if family.name.startswith(PROCESS_SERIES_PREFIXES):   # the library's own, documented apart
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = frozenset(label for sample in family.samples for label in sample.labels if label != "le")
        out[name] = (family.type, labels if family.samples else None)   # (None: no sample to tell)
    return out


def assert_as_documented(served: dict, table: dict) -> None:
    assert {name: kind for name, (kind, _) in served.items()} == {name: kind for name, (kind, _) in table.items()}
    for name, (_, labels) in served.items():
        assert labels is None or labels == table[name][1], (name, sorted(labels), sorted(table[name][1]))


def fetched(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return response.read().decode()


def scraped(address: str) -> dict:
    return series(fetched(address))


def test_the_table_has_each_server():
    assert set(documented()) == {"model service", "manager", "gateway"}


def check_each_server(fleet) -> None:
    """A fleet of one worker, all serving metrics: each server's series are the table's
    (test_gateway_metrics.py runs it on its fleet, which costs its start once)."""
    table = documented()
    worker = fleet.workers[0]
    manager = ManagerMetrics(worker.manager.manager, worker.manager.loop)
    texts = {"model service": fetched(worker.model.servicer.metrics_endpoint.address),
             "gateway": fetched(fleet.gateway.gateway.metrics_endpoint.address),
             "manager": generate_latest(manager.registry).decode()}
    for server, text in texts.items():
        assert_as_documented(series(text), table[server])
        # and the process's own series, as every Prometheus client serves them
        names = {family.name for family in text_string_to_metric_families(text)}
        assert {"process_resident_memory_bytes", "process_cpu_seconds", "process_open_fds",
                "python_gc_collections", "python_info"} <= names, (server, sorted(names))
