"""serve_until_signal in a real process: SIGTERM/SIGINT drain and exit cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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
    serving = asyncio.create_task(serve_until_signal(running.server, running.health, grace_s=1.0))
    await asyncio.sleep(0)  # lets the task install its signal handlers before we say ready
    print(running.address, flush=True)
    await serving

configure_logging("info")
asyncio.run(main())
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_marks_not_serving_then_exits_zero(tmp_path: Path, sig: signal.Signals) -> None:
    script = tmp_path / "server.py"
    script.write_text(SERVER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        address = proc.stdout.readline().strip()
        assert address, f"server did not start: {proc.stderr.read()}"
        with grpc.insecure_channel(address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            proc.send_signal(sig)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert proc.wait(timeout=10) == 0
        assert f"{sig.name} received" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
