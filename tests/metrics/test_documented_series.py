"""docs/architecture.md's table of series names every series each server serves, and only
those: operators build dashboards and alerts from it."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kvserve.kvcache_service.metrics import ManagerMetrics
from tests.gateway.conftest import make_fleet

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def documented() -> dict[str, dict[str, str]]:
    """{server: {series: type}} from the table's rows."""
    out: dict[str, dict[str, str]] = {}
    server = None
    for line in DOC.read_text().splitlines():
        if m := re.match(r"\| \*\*(model service|manager|gateway)\*\* \|", line):
            server = m.group(1)
            out[server] = {}
        elif server and (m := re.match(r"\| `(kvserve:[a-z0-9_]+)` \| (counter|gauge|histogram) \|", line)):
            out[server][m.group(1)] = m.group(2)
        elif server and not line.startswith("|"):
            break
    return out


def series(text: str) -> dict[str, str]:
    """{series: type} from an exposition's TYPE lines (a counter named as scraped, with _total)."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    return {name + ("_total" if kind == "counter" and not name.endswith("_total") else ""): kind
            for name, kind in types.items()}


def scraped(address: str) -> dict[str, str]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return series(response.read().decode())


def test_the_table_has_each_server():
    assert set(documented()) == {"model service", "manager", "gateway"}


@pytest.mark.slow
def test_each_server_serves_the_series_the_table_names(tiny_dirs):
    table = documented()
    for fleet in make_fleet(tiny_dirs["tiny"], 1, worker_config={"metrics_listen": "127.0.0.1:0"},
                            metrics_listen="127.0.0.1:0"):
        worker = fleet.workers[0]
        assert scraped(worker.model.servicer.metrics_endpoint.address) == table["model service"]
        assert scraped(fleet.gateway.gateway.metrics_endpoint.address) == table["gateway"]
        manager = ManagerMetrics(worker.manager.manager, worker.manager.loop)
        assert series(generate_latest(manager.registry).decode()) == table["manager"]
