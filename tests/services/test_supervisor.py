"""What `kvserve up`'s supervisor does with a child that exited, by its exit code: one that
could not listen, or that refused its flags, would fail the same way again and stops the stack
with its code; any other is started again."""

from __future__ import annotations

import sys

import pytest

from kvserve.services.cli.supervisor import EXIT_CANNOT_LISTEN, Child, RestartLimit, Supervisor
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
    assert child.proc is not first and len(child.exits) == 1
    child.proc.wait(30)
