"""A server raises its soft limit on open files to the hard limit at start (a connection, and a
lane stream, per file descriptor), and a client command leaves the limit as it found it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.processes import REPO, free_port, kvserve, terminate, wait_serving

resource = pytest.importorskip("resource")

LOW = 256


def low_soft_limit() -> None:   # in the child, before it runs
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW, hard))


def soft_limit_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open files line")


def expected_raised() -> int:
    """On Linux the hard limit (a kernel never reports it unlimited for open files), up to WANTED."""
    from kvserve.services.plumbing.open_files import WANTED

    return min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], WANTED)


@pytest.fixture(autouse=True)
def room_to_raise():
    if not Path("/proc/self/limits").exists():
        pytest.skip("no /proc/PID/limits to read a process's limits from (Linux only)")
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] <= LOW:
        pytest.skip(f"this machine's hard limit on open files is {LOW} or less: nothing to raise")


def test_the_function_raises_the_soft_limit_to_the_hard_one():
    code = ("from kvserve.services.plumbing.open_files import raise_open_files_limit\n"
            "import resource\n"
            "print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         preexec_fn=low_soft_limit)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(expected_raised())] * 2


def test_a_server_started_under_a_low_soft_limit_raises_it():
    address = f"127.0.0.1:{free_port()}"
    proc = kvserve("kvcache", "--listen", address, "--log-level", "warning", preexec_fn=low_soft_limit)
    try:
        wait_serving(address, proc)
        assert soft_limit_of(proc.pid) == expected_raised()
    finally:
        terminate(proc)


def test_a_client_command_leaves_the_limit_alone():
    code = ("import resource, sys\n"
            "from kvserve.services.cli import main\n"
            "assert main.main(['generate', 'hi', '--max-tokens', '-1', '--address', '127.0.0.1:1']) == 2\n"
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         preexec_fn=low_soft_limit)
    assert out.returncode == 0 and out.stdout.split() == [str(LOW)], out.stderr
