"""serve_until_signal in a real process: SIGTERM/SIGINT drain and exit cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]

SERVER_SCRIPT = """
import asyncio
from kvserve.services.plumbing.grpc_server import create_server, serve_until_signal
from kvserve.services.plumbing.logging_setup import configure_logging

async def main() -> None:
    running = await create_server("127.0.0.1:0", [])
    serving = asyncio.create_task(serve_until_signal(running.server, running.health, grace_s=GRACE_S))
    await asyncio.sleep(0)  # lets the task install its signal handlers before we say ready
    print(running.address, flush=True)
    await serving

import sys
GRACE_S = float(sys.argv[1])
configure_logging("info")
asyncio.run(main())
"""


@contextlib.contextmanager
def server_process(tmp_path: Path, grace_s: float = 1.0):
    """SERVER_SCRIPT running: (its process, its address); killed if a test leaves it running."""
    script = tmp_path / "server.py"
    script.write_text(SERVER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(grace_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        address = proc.stdout.readline().strip()
        assert address, f"server did not start: {proc.stderr.read()}"
        yield proc, address
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_marks_not_serving_then_exits_zero(tmp_path: Path, sig: signal.Signals) -> None:
    with server_process(tmp_path) as (proc, address), grpc.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(sig)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert proc.wait(timeout=10) == 0
        assert f"{sig.name} received" in proc.stderr.read()


def test_sigterm_again_while_draining_does_not_cut_the_drain_short(tmp_path: Path) -> None:
    """A second SIGTERM (a supervisor's, or Kubernetes' after a preStop hook) used to end the
    process at once, its streams reset: the first had put the default handler back."""
    with server_process(tmp_path) as (proc, address), grpc.insecure_channel(address) as channel:
        # The Watch stream stays in flight: the drain waits its 1 s grace for it.
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING   # draining
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "SIGTERM again: already draining" in proc.stderr.read()


@contextlib.contextmanager
def _started(child, ready: Path):
    """`child` started and past the point where it writes `ready`; killed afterwards if it runs."""
    child.start()
    try:
        deadline = time.monotonic() + 10
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        yield child
    finally:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()


def test_up_sends_each_child_one_sigterm(tmp_path: Path) -> None:
    """`up` stops a child with terminate() then stop(): one SIGTERM, not two (a second one used
    to reach a child mid-drain)."""
    from kvserve.services.cli.supervisor import Child

    counted, ready = tmp_path / "sigterms", tmp_path / "ready"
    child = Child("a child", [sys.executable, "-c", f"""
import signal, time
def count(*_):
    with open({str(counted)!r}, "a") as f:
        f.write("x")
signal.signal(signal.SIGTERM, count)
open({str(ready)!r}, "w").close()
time.sleep(1.0)
"""])
    with _started(child, ready):
        child.terminate()
        time.sleep(0.3)   # handled: a second SIGTERM now would not merge with the first
        child.stop(10)
        assert child.proc.returncode == 0
        assert counted.read_text() == "x"


def test_a_second_ctrl_c_under_up_reaches_only_the_children_already_draining(tmp_path: Path) -> None:
    """The children run in sessions of their own, so a terminal's Ctrl-C reaches `up` alone; a
    second one said "stop now" to nobody, and `up` waited out every drain. It now passes SIGINT
    to each child it sent SIGTERM (its second signal: stop now); a child not yet stopping is
    not sent one (as its first signal it would start a drain of its own)."""
    from kvserve.services.cli.supervisor import Child

    def recording(name: str) -> tuple[Child, Path, Path]:
        said, ready = tmp_path / f"{name}.signals", tmp_path / f"{name}.ready"
        child = Child(name, [sys.executable, "-c", f"""
import signal, time
def note(signum, _):
    with open({str(said)!r}, "a") as f:
        f.write(signal.Signals(signum).name + " ")
signal.signal(signal.SIGTERM, note)
signal.signal(signal.SIGINT, note)
open({str(ready)!r}, "w").close()
time.sleep(3)
"""])
        return child, said, ready

    draining, draining_said, draining_ready = recording("draining")
    idle, idle_said, idle_ready = recording("idle")
    with _started(draining, draining_ready), _started(idle, idle_ready):
        draining.terminate()
        time.sleep(0.3)   # handled: the SIGINT after it is not merged with it
        assert draining.hurry() and not idle.hurry()
        draining.stop(10)
        idle.stop(10)
    assert draining_said.read_text().split() == ["SIGTERM", "SIGINT"]
    assert idle_said.read_text().split() == ["SIGTERM"]   # stop()'s own, never a SIGINT


def test_sigint_again_while_draining_stops_now_cleanly(tmp_path: Path) -> None:
    """Ctrl-C twice: the second cuts a long drain short. It used to be Python's KeyboardInterrupt
    tearing the loop down under the server: a traceback, and calls ended CANCELLED unexplained."""
    with server_process(tmp_path, grace_s=600.0) as (proc, address), grpc.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=120)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGINT)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING   # draining, for up to 600 s
        proc.send_signal(signal.SIGINT)
        with pytest.raises(grpc.RpcError) as info:
            next(watch)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert proc.wait(timeout=30) == 0
        stderr = proc.stderr.read()
        assert "SIGINT again: stopping now" in stderr and "Traceback" not in stderr, stderr


def test_a_sighup_sent_while_a_key_checking_child_starts_is_kept_for_it(tmp_path: Path) -> None:
    """`up` passes SIGHUP (re-read the API keys) to the child that checks keys; one sent before
    the child's interpreter had installed its handler killed it (and counted towards
    --max-restarts). The child starts with SIGHUP blocked, and the handler takes it when it comes."""
    from kvserve.services.cli.supervisor import Child

    kept, started = tmp_path / "kept", tmp_path / "started"
    child = Child("a child", [sys.executable, "-c", f"""
import signal, time
open({str(started)!r}, "w").close()
deadline = time.monotonic() + 30
while signal.SIGHUP not in signal.sigpending() and time.monotonic() < deadline:
    time.sleep(0.01)   # the interpreter still starting: no handler yet, the signal come
from kvserve.services.plumbing import api_keys
api_keys.keep_sighup_until_watched()
while not api_keys._sighup_kept and time.monotonic() < deadline:
    time.sleep(0.01)   # taken by the handler once it is installed
open({str(kept)!r}, "w").write(str(len(api_keys._sighup_kept)))
"""], hold_sighup=True)
    with _started(child, started):
        child.signal(signal.SIGHUP)
        assert child.proc.wait(30) == 0, "the child was killed by the SIGHUP"
        assert kept.read_text() == "1"


def test_a_child_that_does_not_stop_is_killed_and_that_is_said(tmp_path: Path, caplog) -> None:
    from kvserve.services.cli.supervisor import Child

    ready = tmp_path / "ready"
    child = Child("a stubborn child", [sys.executable, "-c", f"""
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open({str(ready)!r}, "w").close()
time.sleep(60)
"""])
    with _started(child, ready):
        with caplog.at_level("WARNING", logger="kvserve.up"):
            child.stop(0.5)
        assert child.proc.returncode == -signal.SIGKILL
        assert "a stubborn child did not stop within 0.5 s of SIGTERM: killed" in caplog.text
