"""Starting and watching the real processes (`kvserve up`, `kvserve model`, `kvserve kvcache`)
from tests: addresses, health, children, teardown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.kvcache.v1 import kvcache_pb2 as kv_pb
from kvserve.kvcache.v1 import kvcache_pb2_grpc as kv_pb_grpc

REPO = Path(__file__).resolve().parents[2]
HEALTH_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unix_address(tmp_path: Path) -> str:
    path = tmp_path / "kv.sock"
    if len(os.fsencode(str(path))) > 100:  # sun_path limit
        path = Path(tempfile.mkdtemp(prefix="kv")) / "kv.sock"
    return f"unix://{path}"


def kvserve(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvserve.services.cli.main", *args], cwd=REPO, **popen)


def wait_serving(address: str, proc: subprocess.Popen, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """Polls grpc.health.v1 until the server says SERVING; fails if `proc` exits first."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while True:
            assert proc.poll() is None, f"the process exited with {proc.returncode} while starting"
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"{address} not SERVING within {timeout} s"
            time.sleep(0.2)


def children(pid: int) -> list[int]:
    """Pids whose parent is `pid` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def terminate(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_pids(pids: list[int]) -> None:
    """Teardown of processes this module started (directly or through `up`), by pid."""
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def kv_stats(kv_address: str) -> kv_pb.Stats:
    with grpc.insecure_channel(kv_address) as ch:
        return kv_pb_grpc.KVCacheManagerStub(ch).GetStats(kv_pb.GetStatsRequest(), timeout=5)
