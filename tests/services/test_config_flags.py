"""Flags generated from a config dataclass: parsing to_argv(config) gives config back, for any
valid config, and a flag left out takes the dataclass's default."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from kvserve.kvcache_service.core.config import ManagerConfig
from kvserve.model_service.config import ATTENTION_BACKENDS, CPU_GEMMS, DTYPES, ModelServiceConfig
from kvserve.services.plumbing.config_flags import add_arguments, from_args, option, to_argv

POSITIVE = st.integers(1, 2**20)
MAYBE = st.none() | POSITIVE
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=12) | st.sampled_from(
    ["-salt", "--x", "-1", "a=b"])   # a value that starts with a dash must stay a value


def _round_trip(cls, config):
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    return from_args(cls, parser.parse_args(to_argv(config)))


ADDRESSES = st.sampled_from(["127.0.0.1:0", "0.0.0.0:50051", "[::1]:1", "localhost:65535", "unix:///tmp/a b.sock",
                             "unix:rel/kv.sock", "worker-0.kvserve.svc:50051"])


def _model_configs(num_pages, kv_cache_memory):
    return st.builds(ModelServiceConfig, model=TEXT, dtype=st.sampled_from(DTYPES),
                     attention_backend=st.sampled_from(ATTENTION_BACKENDS), cpu_gemm=st.sampled_from(CPU_GEMMS),
                     page_size=MAYBE, num_pages=num_pages, kv_cache_memory=kv_cache_memory, max_num_seqs=POSITIVE,
                     gpu_memory_utilization=st.floats(0.01, 1.0), swap_pages=st.integers(0, 99),
                     max_model_len=st.none() | st.integers(2, 2**20), cache_salt=st.just("") | TEXT,
                     prefix_caching=st.booleans(),
                     grace_s=st.floats(0, 60), listen=ADDRESSES)


@given(_model_configs(MAYBE, st.none()) | _model_configs(st.none(), MAYBE))   # the pool sized one way at most
def test_model_service_configs_round_trip(config) -> None:
    assert _round_trip(ModelServiceConfig, config) == config


@given(st.builds(ManagerConfig, num_pages=POSITIVE, page_size=POSITIVE, max_seqs=POSITIVE,
                 cpu_pages=st.integers(0, 99), event_capacity=POSITIVE))
def test_manager_configs_round_trip(config) -> None:
    assert _round_trip(ManagerConfig, config) == config


@dataclass(frozen=True)
class Example:
    names: tuple[str, ...] = option(("a",), "repeatable")
    on: bool = option(False, "off unless given")
    limit: int | None = option(None, "none unless given")


def test_repeated_flags_booleans_and_optionals() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, Example)
    assert from_args(Example, parser.parse_args([])) == Example()
    got = from_args(Example, parser.parse_args(["--names", "x", "--names", "y", "--on", "--limit", "3"]))
    assert got == Example(("x", "y"), True, 3)
    assert to_argv(got) == ["--names=x", "--names=y", "--on", "--limit=3"]
