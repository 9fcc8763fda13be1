"""A container's first process: the kernel ignores a signal PID 1 has no handler for, so a model
service that SIGTERM reached while it loaded (a pod deleted or rolled) went on loading and was
killed at the end of the grace period. Run here as PID 1 of a PID namespace of its own."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from tests.service.processes import REPO, children, stop_pids

pytestmark = pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")


def _as_pid_1(*argv: str) -> subprocess.Popen:
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no PID namespace here: {probe.stderr.decode().strip()}")
    return subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m",
                             "kvserve.services.cli.main", *argv], cwd=REPO, stderr=subprocess.PIPE, text=True)


def test_sigterm_ends_a_model_service_that_is_still_starting_as_pid_1(tiny_dirs, tmp_path):
    # a manager that never answers: the model service waits for it (--kvcache-timeout) once loaded
    proc = _as_pid_1("model", "--model", str(tiny_dirs["tiny"]), "--listen", f"unix://{tmp_path}/m.sock",
                     "--kvcache", f"unix://{tmp_path}/nobody.sock", "--kvcache-timeout", "120", "--device", "cpu")
    try:
        deadline = time.monotonic() + 30
        while not (kids := children(proc.pid)):
            assert time.monotonic() < deadline, "unshare started nothing"
            time.sleep(0.05)
        pid_1 = kids[0]
        time.sleep(1.0)
        ended_by = time.monotonic() + 30   # its imports come before the handler: SIGTERM again until it is there
        while proc.poll() is None and time.monotonic() < ended_by:
            subprocess.run(["kill", "-TERM", str(pid_1)], capture_output=True)
            try:
                proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        assert proc.poll() is not None, "SIGTERM did not end a model service starting as PID 1"
        assert "SIGTERM while starting: exiting" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            stop_pids(children(proc.pid))
            proc.kill()
        proc.wait(10)
        proc.stderr.close()
