"""Reading a /metrics endpoint in tests: {(name, frozenset(labels)): value}."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(address: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    """The sample's value; a KeyError names what is there when it is missing."""
    key = (name, frozenset(labels.items()))
    if key not in samples:
        near = sorted(f"{n}{dict(ls)}" for n, ls in samples if n == name)
        raise KeyError(f"{name}{labels} not scraped; {name} has: {near or 'nothing'}")
    return samples[key]
