"""Flags come from the config dataclasses: `kvserve up` and `kvserve model` take every model-service
option, `kvserve kvcache` every manager size, and `kvserve up` hands each child its config
unchanged, without restating a default."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvserve.kvcache_service import cli as kvcache_cli
from kvserve.kvcache_service.config import KVCacheServerConfig
from kvserve.kvcache_service.core.config import ManagerConfig
from kvserve.model_service import cli as model_cli
from kvserve.model_service.config import ModelServiceConfig
from kvserve.services.cli import up
from kvserve.services.plumbing.config_flags import from_args, options, to_argv


def _parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser()
    sub = root.add_subparsers()
    up.register(sub)
    model_cli.register(sub)
    kvcache_cli.register(sub)
    return root


def _dests(command: str) -> set[str]:
    sub = _parser()._subparsers._group_actions[0].choices[command]
    return {a.dest for a in sub._actions if a.dest != "help"}


def test_every_config_field_with_help_is_a_flag_of_its_commands():
    model = {f.name for f in options(ModelServiceConfig)}
    assert model == {f.name for f in dataclasses.fields(ModelServiceConfig)}   # no field without a flag
    assert _dests("model") == model
    assert _dests("up") == (model - set(up.WIRED_BY_UP)) | {f.name for f in options(up.UpConfig)}
    assert _dests("kvcache") == {f.name for f in dataclasses.fields(ManagerConfig)} | {
        f.name for f in dataclasses.fields(KVCacheServerConfig)}


def test_forwarded_values_reach_the_model_config():
    root = _parser()
    args = root.parse_args(["up", "--model", "bench", "--stream-interval", "4", "--max-num-seqs", "7",
                            "--max-waiting", "9", "--kv-cache-memory", "64MiB", "--no-prefix-caching",
                            "--cpu-gemm", "onednn"])
    sent = from_args(ModelServiceConfig, args)
    cfg = from_args(ModelServiceConfig, root.parse_args(["model", *to_argv(sent)]))
    assert cfg == sent
    assert (cfg.model, cfg.stream_interval, cfg.max_num_seqs, cfg.max_waiting) == ("bench", 4, 7, 9)
    assert cfg.kv_cache_memory == 64 * 2**20 and cfg.prefix_caching is False and cfg.cpu_gemm == "onednn"


def test_the_gateway_in_front_of_workers_drains_as_long_as_the_flag_says():
    """--grace-period reached the workers only, behind the gateway: on SIGTERM the gateway cut
    every stream at its own default of 5 s."""
    flags = up.front_flags(ModelServiceConfig(grace_s=60, api_keys="keys"))
    assert "--grace-period=60" in flags and "--api-keys=keys" in flags
    assert "--grace-period=5.0" in up.front_flags(ModelServiceConfig())


def test_max_waiting_bounds_the_gateways_queue_in_front_of_workers():
    """With workers, requests wait in the gateway's queue: --max-waiting was left out there, and a
    stack of --max-waiting 1 queued 1,024."""
    assert "--max-queued=1" in up.front_flags(ModelServiceConfig(max_waiting=1))


def test_the_gateway_in_front_of_workers_bounds_n_as_they_do():
    assert "--max-n=4" in up.front_flags(ModelServiceConfig(max_n=4))


def test_the_http_apis_browser_origins_go_to_the_gateway_in_front():
    flags = up.front_flags(ModelServiceConfig(http_listen="0.0.0.0:8000", http_allowed_origins="*"))
    assert "--http-allowed-origins=*" in flags
    assert not any("allowed-origins" in f for f in up.front_flags(ModelServiceConfig()))


def test_max_seqs_past_32_bits_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="--max-seqs must be a positive integer of at most 4,294,967,295"):
        up.UpConfig(max_seqs=2**32)


def test_the_gateways_flags_keep_values_that_begin_with_a_dash():
    """A salt such as "-prod" was read as a flag by the gateway, which exited 2, restarted, and
    stopped the stack."""
    from kvserve.services.cli.main import build_parser
    from kvserve.services.gateway.config import GatewayConfig
    from kvserve.services.plumbing.config_flags import from_args

    argv = up.gateway_argv(ModelServiceConfig(cache_salt="-prod", listen="127.0.0.1:5"), ["unix:///w0", "unix:///w1"],
                           ["--metrics-listen=127.0.0.1:9"])
    config = from_args(GatewayConfig, build_parser().parse_args(argv), "kvserve gateway")
    assert (config.cache_salt, config.listen, config.worker) == ("-prod", "127.0.0.1:5", ("unix:///w0", "unix:///w1"))


def test_a_child_gets_only_what_differs_from_the_defaults():
    assert to_argv(ModelServiceConfig()) == []
    assert to_argv(ModelServiceConfig(max_num_seqs=7, grace_s=2.5)) == ["--max-num-seqs=7", "--grace-period=2.5"]
    assert to_argv(ManagerConfig(num_pages=99)) == ["--num-pages=99"]


def test_the_manager_is_sized_by_one_function_whatever_the_launcher():
    cfg = ModelServiceConfig(max_num_seqs=200, swap_pages=12)
    assert cfg.manager_config(64, 4) == ManagerConfig(num_pages=64, page_size=4, max_seqs=400, cpu_pages=12)
    assert ModelServiceConfig().manager_config(64, 4).max_seqs == 256                 # at least 256
    assert cfg.manager_config(64, 4, max_seqs=9).max_seqs == 9                         # kvserve up --max-seqs


@pytest.mark.parametrize("argv, words", [
    (["model", "--dtype", "float8"], "--dtype must be auto, float32, bfloat16 or float16, got 'float8'"),
    (["up", "--max-num-seqs", "0"], "--max-num-seqs must be a positive integer, got 0"),
    (["up", "--max-seqs", "-1"], r"--max-seqs must be a positive integer of at most 4,294,967,295 \(the protocol's ids "
                                  r"are 32-bit\), got -1"),
    (["model", "--max-waiting", "4294967296"], "--max-waiting must be at most 4294967295, got 4294967296"),
    (["model", "--max-request-bytes", "2GiB"], r"--max-request-bytes must be at most 2147483647 \(gRPC's limit\)"),
    (["model", "--kvcache-timeout", "inf"], "--kvcache-timeout must be under 1e9 seconds, got inf"),
    (["model", "--listen="], "--listen: empty listen address"),
    (["model", "--cpu-threads", "2147483648"], "--cpu-threads must be an integer from 0 to 4096"),
    (["model", "--max-model-len", "1"], "--max-model-len must be at least 2"),
    (["up", "--startup-timeout", "nan"], "--startup-timeout must be positive, got nan"),
    (["kvcache", "--num-pages", "0"], "^kvserve: --num-pages must be a positive integer, got 0"),   # the flag, not the field
    (["kvcache", "--cpu-pages", "-1"], "^kvserve: --cpu-pages must be a non-negative integer"),
    (["model", "--listen", "127.0.0.1"], "--listen: '127.0.0.1': missing port"),
    (["up", "--health-listen", "0.0.0.0:70000"], "--health-listen: '0.0.0.0:70000': port 70000 is out of range"),
    (["up", "--kvcache-listen", "kv"], "--kvcache-listen: 'kv': missing port"),
    (["up", "--num-pages", "100", "--kv-cache-memory", "1GiB"],
     "--num-pages and --kv-cache-memory both size the page pool; give one"),
    (["model", "--attention-backend", "flash_attn", "--device", "cpu"],
     "--attention-backend flash_attn runs on CUDA only; on --device cpu choose auto, cpu or torch"),
    (["model", "--device", "bogus"], "--device must be auto, cpu, cuda or cuda:N, got 'bogus'"),   # before the model loads
    (["model", "--served-model-name", " gpt"], "--served-model-name must be printable, with no space at either end"),
    (["up", "--served-model-name", "a\tb"], "--served-model-name must be printable"),
    (["model", "--served-model-name", "m" * 257], "and at most 256 characters"),
    (["up", "--http-allowed-origins", "https://a.example.com/chat"], "--http-allowed-origins: 'https://a.example.com/chat' "
                                                                      "is not an origin"),
])
def test_a_bad_value_exits_with_the_dataclass_message(argv, words):
    from kvserve.services.plumbing.config_flags import EXIT_BAD_FLAGS

    args = _parser().parse_args(argv)
    cls = {"model": ModelServiceConfig, "kvcache": ManagerConfig}.get(argv[0])
    with pytest.raises(SystemExit, match=words) as exited:
        if cls is None:
            from_args(up.UpConfig, args)
            from_args(ModelServiceConfig, args)
        else:
            from_args(cls, args)
    assert exited.value.code == EXIT_BAD_FLAGS   # as argparse's own refusals exit


@pytest.mark.parametrize("argv, words", [
    (["--overlap-weight", "nan"], "--overlap-weight must be a finite number, 0 or more, got nan"),
    (["--overlap-weight", "inf"], "--overlap-weight must be a finite number, 0 or more, got inf"),
    (["--dns-interval", "1e-9"], "--dns-interval must be from 0.1 to 86400 seconds"),
    (["--max-request-bytes", "3GiB"], "--max-request-bytes must be at most 2147483647"),
])
def test_a_bad_gateway_value_exits_with_its_flag_named(argv, words):
    """NaN or inf weights made every cost NaN (each request UNKNOWN from min() of nothing); a
    nanosecond DNS interval spun a core; a request limit past a C int killed the server at start."""
    from kvserve.services.cli.main import build_parser
    from kvserve.services.gateway.config import GatewayConfig

    with pytest.raises(SystemExit, match=words):
        from_args(GatewayConfig, build_parser().parse_args(["gateway", "--worker", "127.0.0.1:1", *argv]))


def test_sizes_take_tib_and_refuse_infinity():
    import argparse

    from kvserve.services.plumbing.config_flags import parse_bytes

    assert parse_bytes("1TiB") == 2**40
    for text in ("inf", "infgib", "1e400"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
            parse_bytes(text)


def _together(argv: list[str]) -> None:
    args = _parser().parse_args(["up", "--model", "tiny", *argv])
    up.check_together(from_args(up.UpConfig, args), from_args(ModelServiceConfig, args))


def test_one_address_for_two_servers_stops_up_before_it_starts_anything():
    with pytest.raises(SystemExit, match="--listen and --kvcache-listen are both 127.0.0.1:50999"):
        _together(["--listen", "127.0.0.1:50999", "--kvcache-listen", "127.0.0.1:50999"])
    _together(["--listen", "127.0.0.1:50998", "--kvcache-listen", "127.0.0.1:50999"])


def test_a_manager_address_with_workers_is_said_to_be_unused(caplog):
    _together(["--workers", "2", "--kvcache-listen", "127.0.0.1:50999"])
    assert any("--kvcache-listen 127.0.0.1:50999 is not used: with --workers" in r.getMessage()
               for r in caplog.records)


def test_a_lane_address_with_workers_is_said_to_be_unused(caplog):
    _together(["--workers", "2", "--lane-listen", "127.0.0.1:50997"])
    assert any("--lane-listen 127.0.0.1:50997 is not used: with --workers" in r.getMessage() for r in caplog.records)


def test_a_restarted_model_service_takes_the_pool_size_alone(tmp_path, monkeypatch):
    """A pool sized by --kv-cache-memory is passed on as --num-pages, without the memory flag the
    two would contradict."""
    monkeypatch.setattr(up.Child, "start", lambda self: None)
    pair = up.Pair.make("worker", ["kvserve"], ModelServiceConfig(kv_cache_memory=64 * 2**20), tmp_path, None, None)
    pair.start_manager(["kvserve"], {"num_pages": 100, "page_size": 16}, None)
    argv = pair.model.argv
    restarted = from_args(ModelServiceConfig, _parser().parse_args(argv[argv.index("model"):]))
    assert (restarted.num_pages, restarted.page_size, restarted.kv_cache_memory) == (100, 16, None)


def test_the_admin_token_file_reaches_the_manager(tmp_path, monkeypatch):
    """`kvserve up --admin-token-file` lets a caller beyond this machine use the manager on its TCP
    --kvcache-listen, as `kvserve kvcache --admin-token-file` does."""
    monkeypatch.setattr(up.Child, "start", lambda self: None)
    pair = up.Pair.make("worker", ["kvserve"], ModelServiceConfig(model="tiny"), tmp_path, "127.0.0.1:50051", None,
                        admin_token_file="/secrets/admin")
    pair.start_manager(["kvserve"], {"num_pages": 64, "page_size": 16}, None)
    argv = pair.manager.argv
    server = from_args(KVCacheServerConfig, _parser().parse_args(argv[argv.index("kvcache"):]))
    assert server.admin_token_file == "/secrets/admin"
    assert "127.0.0.1:50051" in server.listen


def test_workers_on_one_machine_share_its_cores_unless_told():
    """Each of N workers taking every core ran N thread pools on the same cores: 4 workers of
    2 threads on 2 cores streamed a quarter of what 4 of 1 thread did (docs/benchmarks.md)."""
    from kvserve.services.cli.up import worker_threads

    assert worker_threads(0, 4, cores=2) == 1
    assert worker_threads(0, 2, cores=16) == 8
    assert worker_threads(0, 3, cores=16) == 5
    assert worker_threads(3, 4, cores=2) == 3   # --cpu-threads as given


def test_each_workers_manager_starts_as_soon_as_its_model_service_is_sized(tmp_path):
    """They started in the workers' order: a worker sized a minute before an earlier one waited
    that minute for its manager, past its --kvcache-timeout, and exited."""
    import json
    import threading
    import time
    from types import SimpleNamespace

    from kvserve.services.cli.supervisor import Supervisor
    started: list[str] = []

    def pair(name: str):
        model = SimpleNamespace(exited=lambda: False)
        return SimpleNamespace(sizing=tmp_path / f"{name}.json", model=model,
                               start_manager=lambda cli, size, max_seqs: started.append((name, size["num_pages"])))
    slow, fast = pair("worker-0"), pair("worker-1")
    fast.sizing.write_text(json.dumps({"num_pages": 7}))

    def size_slow_later() -> None:
        deadline = time.monotonic() + 10
        while not started and time.monotonic() < deadline:
            time.sleep(0.01)
        slow.sizing.write_text(json.dumps({"num_pages": 3}))
    threading.Thread(target=size_slow_later, daemon=True).start()
    config = up.UpConfig(startup_timeout_s=30)
    assert up._start_managers([slow, fast], [], config, {"signal": None}, Supervisor(3, stopping=lambda: False))
    assert started == [("worker-1", 7), ("worker-0", 3)]


def test_a_model_service_that_refuses_to_start_stops_the_others_wait(tmp_path, caplog):
    from types import SimpleNamespace

    from kvserve.services.cli.supervisor import Supervisor
    gone = SimpleNamespace(exited=lambda: True, proc=SimpleNamespace(returncode=2), exit_reason=lambda: "exited with 2")
    pairs = [SimpleNamespace(sizing=tmp_path / f"{i}.json", model=gone, start_manager=None) for i in range(2)]
    assert not up._start_managers(pairs, [], up.UpConfig(startup_timeout_s=30), {"signal": None},
                                  Supervisor(3, stopping=lambda: False))
    assert "the model service exited with 2 while starting" in caplog.text
