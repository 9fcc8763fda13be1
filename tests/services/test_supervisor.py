"""What `kvserve up`'s supervisor does with a child that exited, by its exit code: one that
could not listen, or that refused its flags, would fail the same way again and stops the stack
with its code; any other is started again."""

from __future__ import annotations

import os
import sys

import pytest

from kvserve.services.cli.supervisor import EXIT_CANNOT_LISTEN, STEADY_S, Child, RestartLimit, Supervisor
from kvserve.services.plumbing.config_flags import EXIT_BAD_FLAGS


def exited_child(code: int) -> Child:
    child = Child("the test child", [sys.executable, "-c", f"raise SystemExit({code})"])
    child.start()
    child.proc.wait(30)
    return child


@pytest.mark.parametrize("code, said", [(EXIT_CANNOT_LISTEN, "cannot listen on its address"),
                                        (EXIT_BAD_FLAGS, "refused the flags it was given")])
def test_a_child_that_would_fail_the_same_way_stops_the_stack_with_its_code(code, said):
    child = exited_child(code)
    with pytest.raises(RestartLimit, match=said) as stopped:
        Supervisor(5, stopping=lambda: False).restart(child)
    assert stopped.value.exit_code == code and not child.exits   # not counted as a restart either


def test_any_other_exit_is_started_again():
    child = exited_child(1)
    supervisor = Supervisor(5, stopping=lambda: False)
    supervisor.sleep = lambda seconds: None   # no backoff to wait out here
    first = child.proc
    supervisor.restart(child)
    assert child.proc is not first and len(child.exits) == 1 and child.restarts == 1   # (up's metrics serve it)
    child.proc.wait(30)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_child_whose_supervisor_died_before_it_was_armed_never_runs(monkeypatch):
    """Between fork and prctl, `up` may die: the child then must not go on to exec its server,
    which would serve (and hold its ports) with nobody to stop it. It sent itself SIGTERM, which
    the fork of `up` it still was handled (it has `up`'s handler) and went on."""
    import signal
    import subprocess

    from kvserve.services.cli.supervisor import _before_exec
    previous = signal.signal(signal.SIGTERM, lambda *_: None)   # as `up` has one
    try:
        arm = _before_exec(parent=os.getpid() + 1_000_000, hold_sighup=False)   # not this child's parent
        proc = subprocess.Popen([sys.executable, "-c", "print('served')"], preexec_fn=arm,
                                stdout=subprocess.PIPE)
        out, _ = proc.communicate(timeout=30)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert proc.returncode == 1 and out == b""


def test_a_child_slow_to_fail_is_stopped_after_as_many_exits_in_a_row_without_serving(tmp_path, monkeypatch):
    """A model service that loads for more than STEADY_S and then fails the same way: each run
    looked steady (it ran 30 s) and each cycle was slower than the minute's window counts, so it
    was started again for good. A run counts as steady once the child said it serves (its ready
    file) and served STEADY_S."""
    clock, _, child, supervisor = failing_model_service(tmp_path, monkeypatch)
    with pytest.raises(RestartLimit, match="4 exits in a row without serving for 30 s"):
        for _ in range(10):
            child.proc.wait(30)
            clock["now"] += 120.0   # a slow load, then the failure: never two in a minute
            supervisor.restart(child)
    child.proc.wait(30)


def test_a_child_that_served_long_enough_starts_its_count_again(tmp_path, monkeypatch):
    clock, ready, child, supervisor = failing_model_service(tmp_path, monkeypatch)
    for _ in range(10):
        assert not ready.exists() and child.ready_at is None   # a run's ready file is its own
        child.proc.wait(30)
        ready.touch()
        child.look_for_ready()   # as up's loop does
        clock["now"] += STEADY_S + 1   # it served STEADY_S before it failed (whatever the wall clock did)
        child.exits.clear()
        supervisor.restart(child)   # never RestartLimit: each run recovered
        assert child.unsteady == 0
    child.proc.wait(30)


def failing_model_service(tmp_path, monkeypatch):
    """A child that fails at once, with a ready file, under a monotonic clock of the test's own;
    started. -> (clock, its ready file, the child, a supervisor allowing 3 a minute)."""
    from kvserve.services.cli import supervisor as module

    clock = {"now": 1000.0}
    monkeypatch.setattr(module.time, "monotonic", lambda: clock["now"])
    ready = tmp_path / "ready"
    child = Child("the model service", [sys.executable, "-c", "raise SystemExit(1)"], ready_path=ready)
    supervisor = Supervisor(3, stopping=lambda: False)
    supervisor.sleep = lambda seconds: None
    child.start()
    return clock, ready, child, supervisor
