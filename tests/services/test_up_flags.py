"""`kvserve up` hands every model-service option to the model process, unchanged."""

from __future__ import annotations

import argparse

from kvserve.model_service import cli as model_cli
from kvserve.services.cli import up


def _parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser()
    sub = root.add_subparsers()
    up.register(sub)
    model_cli.register(sub)
    return root


def test_every_model_option_is_forwarded():
    options = argparse.ArgumentParser()
    model_cli.add_model_arguments(options)
    dests = {a.dest for a in options._actions if a.dest != "help"}
    forwarded = set(up._MODEL_FLAGS) | {"prefix_caching"}   # the one store_false flag
    assert dests == forwarded, f"not forwarded: {dests - forwarded}; unknown: {forwarded - dests}"


def test_forwarded_values_reach_the_model_config():
    root = _parser()
    args = root.parse_args(["up", "--model", "bench", "--stream-interval", "4", "--max-num-seqs", "7",
                            "--max-waiting", "9", "--kv-cache-memory", "64MiB", "--no-prefix-caching",
                            "--cpu-gemm", "onednn"])
    model_args = root.parse_args(["model", *up._flag_args(args)])
    cfg = model_cli.model_config(model_args)
    assert (cfg.model, cfg.stream_interval, cfg.max_num_seqs, cfg.max_waiting) == ("bench", 4, 7, 9)
    assert cfg.kv_cache_memory == 64 * 2**20 and cfg.prefix_caching is False and cfg.cpu_gemm == "onednn"
