"""What the kvserve command says, as a process, when it cannot start: one line naming the cause
and an exit code a script or the supervisor reads (2 for a bad flag, as argparse's own
refusals; 1 for a file, a model or a peer it cannot use; 3 for an address it cannot listen on:
never restarted), never a traceback, and at once rather than after a timeout or restarts."""

from __future__ import annotations

import shutil
import socket
import subprocess

import pytest

from kvserve.model_service.prompt_tokens import resolve_model_path
from tests.service.processes import free_port, kvserve

TIMEOUT_S = 120


def run(*args: str) -> tuple[int, str]:
    proc = kvserve(*args, "--log-level", "warning", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"kvserve {' '.join(args)} did not give up")
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    return proc.returncode, stderr.strip()


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("flags, message", [
    (["--kvcache", "127.0.0.1:99999"], "--kvcache: "),
    (["--kvcache", "127.0.0.1:0"], "--kvcache 127.0.0.1:0: a server is dialled on a port from 1 to 65535"),
    (["--http-listen", "unix:///tmp/kvserve-http.sock"], "--http-listen must be host:port"),
])
def test_an_address_the_model_service_cannot_use_is_refused_before_the_model_loads(flags, message):
    code, stderr = run("model", "--model", "tiny", "--listen", f"127.0.0.1:{free_port()}", *flags)
    assert code == 2 and message in stderr.splitlines()[-1], stderr


@pytest.mark.parametrize("command, flags, message", [
    ("kvcache", ["--listen", ""], "--listen: "),
    ("kvcache", ["--health-listen", "bogus"], "--health-listen: 'bogus'"),
    ("kvcache", ["--metrics-listen", "bogus"], "--metrics-listen: 'bogus'"),
    ("gateway", ["--listen", ""], "--listen: "),
    ("gateway", ["--metrics-listen", "unix:///tmp/m.sock"], "--metrics-listen must be host:port"),
    ("model", ["--metrics-listen", "bogus"], "--metrics-listen: 'bogus'"),
])
def test_every_listen_flag_is_checked_at_start_and_named(command, flags, message):
    """Each refused at start naming its flag, before a model or tokenizer loads (some named none)."""
    base = {"kvcache": ["--listen", f"127.0.0.1:{free_port()}"], "model": ["--listen", f"127.0.0.1:{free_port()}"],
            "gateway": ["--listen", f"127.0.0.1:{free_port()}", "--worker", "127.0.0.1:1"]}[command]
    code, stderr = run(command, *base, *flags)
    assert code == 2 and message in stderr.splitlines()[-1], stderr


@pytest.mark.parametrize("spoil, message", [
    (lambda d: (d / "config.json").write_text("{not json"), "is not a valid JSON file"),
    (lambda d: (d / "model.safetensors").unlink(), "no *.safetensors in"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64), "Error while deserializing header"),
])
def test_a_model_directory_that_does_not_load_is_named_in_one_line(tmp_path, spoil, message):
    model = tmp_path / "model"
    shutil.copytree(resolve_model_path("tiny"), model)
    spoil(model)
    code, stderr = run("model", "--model", str(model), "--kvcache", "inprocess", "--listen", f"127.0.0.1:{free_port()}")
    last = stderr.splitlines()[-1]
    assert code != 0 and last.startswith(f"kvserve model: cannot load a model from {model}: ") and message in last


def test_make_tiny_model_names_a_directory_it_cannot_write():
    code, stderr = run("make-tiny-model", "/dev/null/tiny")
    assert code != 0 and stderr == "kvserve make-tiny-model: cannot write /dev/null/tiny: Not a directory"


@pytest.mark.parametrize("seed", ["99999999999999999999999", "-1", "x"])
def test_make_tiny_model_refuses_a_seed_torch_cannot_take(seed, tmp_path):
    code, stderr = run("make-tiny-model", str(tmp_path / "m"), "--seed", seed)
    assert code == 2 and stderr.splitlines()[-1].startswith("kvserve make-tiny-model: error: argument --seed: ")
    assert "Traceback" not in stderr


def test_a_busy_metrics_port_stops_the_manager_at_once(busy_port):
    code, stderr = run("kvcache", "--listen", f"127.0.0.1:{free_port()}", "--metrics-listen", busy_port)
    assert code == 3 and stderr.splitlines()[-1].startswith(f"kvserve kvcache: cannot serve metrics on {busy_port}")


def test_up_stops_at_once_when_its_http_port_is_busy(busy_port):
    """The model service exits 3 (not 1, a crash): the stack stops instead of restarting it five times,
    and exits 3 itself, as each command alone does (a supervisor above it must not restart it either)."""
    code, stderr = run("up", "--model", "tiny", "--listen", f"127.0.0.1:{free_port()}", "--kvcache-listen",
                       f"127.0.0.1:{free_port()}", "--http-listen", busy_port, "--num-pages", "64")
    assert code == 3 and f"cannot serve HTTP on {busy_port}" in stderr and "starting it again" not in stderr, stderr


def test_a_unix_socket_in_a_directory_that_does_not_exist_is_named():
    code, stderr = run("kvcache", "--listen", "unix:///nonexistent-dir/kv.sock")
    assert code == 3 and stderr.splitlines()[-1] == ("kvserve kvcache: cannot listen on unix:///nonexistent-dir/kv.sock: "
                                                     "the directory /nonexistent-dir does not exist")


def test_a_failed_tls_handshake_is_one_line_without_grpcs_own_log():
    """gRPC printed its INFO line for the handshake above the command's sentence."""
    from kvserve.kvcache_service.core import ManagerConfig
    from tests.kvcache.conftest import ServerThread

    plaintext = ServerThread("127.0.0.1:0", ManagerConfig(num_pages=16, page_size=4, max_seqs=8))
    try:
        code, stderr = run("stats", "--address", plaintext.address, "--tls")
    finally:
        plaintext.stop()
    assert code != 0 and len(stderr.splitlines()) == 1 and stderr.startswith("kvserve stats: UNAVAILABLE"), stderr


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_a_grace_period_that_is_no_number_of_seconds_is_refused_by_every_server(value):
    """NaN passed the old `< 0` checks, and a drain compared against it ended every stream at once."""
    from kvserve.kvcache_service.config import KVCacheServerConfig
    from kvserve.model_service.config import ModelServiceConfig
    from kvserve.services.gateway.config import GatewayConfig
    for config, kwargs in [(ModelServiceConfig, {}), (KVCacheServerConfig, {}), (GatewayConfig, {"worker": ["127.0.0.1:1"]})]:
        with pytest.raises(ValueError, match=r"--grace-period must be a number of seconds, 0 or more, got"):
            config(grace_s=value, **kwargs)


def test_up_names_an_admin_token_file_it_cannot_read_before_starting_anything(tmp_path):
    code, stderr = run("up", "--model", "tiny", "--listen", f"127.0.0.1:{free_port()}", "--kvcache-listen",
                       f"127.0.0.1:{free_port()}", "--admin-token-file", str(tmp_path / "missing"))
    assert code != 0 and "cannot read the admin token file" in stderr.splitlines()[-1], stderr
