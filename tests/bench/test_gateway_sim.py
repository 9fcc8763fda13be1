"""bench/gateway_sim.py on a small fleet: the gateway's own routing and index against simulated
workers route to cached prefixes far more often than random does, and the index's memory count
sees its pages."""

from __future__ import annotations

from types import SimpleNamespace

from bench.gateway_sim import object_bytes, simulate
from kvserve.services.gateway.index import PrefixIndex

ARGS = SimpleNamespace(conversations=150, turns=3, systems=4, system=64, reply=8, rate=50.0, think_s=1.0,
                       pages=256, max_num_seqs=4, prefill_us=100.0, decode_us=20_000.0, report_ms=50.0,
                       balance_slack=2, seed=0, all_holders=False)


def test_cache_aware_routing_finds_far_more_of_the_prompts_than_random():
    cache, rnd = simulate(20, ARGS, "cache"), simulate(20, ARGS, "random")
    assert rnd["hit"] < cache["hit"] <= cache["oracle"]
    assert cache["index_pages"] > 0 and cache["memory_mib"] > 0
    assert sum(cache["spread"][:2]) > 0


def test_object_bytes_counts_each_object_once():
    one, twice = SimpleNamespace(), SimpleNamespace()
    one.a = list(range(1000, 1100))
    twice.a = twice.b = list(range(1000, 1100))
    assert object_bytes(one) > 100 * 28 and object_bytes(twice) - object_bytes(one) < 100   # the name "b" only
    index = PrefixIndex()
    index.add("w", range(1000, 2000))
    held = object_bytes(index)
    index.add("w", range(1000, 2000))   # pages it holds already: nothing new
    assert object_bytes(index) == held
