"""Keeps `kvserve up`'s children running: a child that exits is started again after a backoff,
unless it has exited too often in the last minute; then the stack stops, with the reason.

Mechanism only: up.py says what each child is and what a restart of one means for the other.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.services.plumbing.config_flags import EXIT_BAD_FLAGS

log = logging.getLogger("kvserve.up")

PR_SET_PDEATHSIG = 1
# A server that cannot listen (its address in use or not permitted) exits with this (services/cli/
# main.py); it is not started again, since it would only fail the same way.
EXIT_CANNOT_LISTEN = 3


def _before_exec(parent: int, hold_sighup: bool) -> Callable[[], None] | None:
    """What a child runs before its program. Linux: SIGTERM when `up` dies, even by SIGKILL, so
    that no child goes on serving (and holding its ports and sockets) without its supervisor.
    `hold_sighup`: SIGHUP starts blocked (a mask outlives exec), so one sent while the child's
    interpreter starts stays pending until the child has a handler for it
    (api_keys.keep_sighup_until_watched) instead of killing it. Resolved here, in the parent:
    nothing is imported between fork and exec."""
    prctl = None
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            pass
    if prctl is None and not hold_sighup:
        return None

    def arm() -> None:
        if hold_sighup:
            signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGHUP,))
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:   # `up` died before the line above: no exec. (A SIGTERM to
                os._exit(1)              # itself would meet the handler this fork of `up` still has.)
    return arm

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0
STEADY_S = 30.0     # a child that ran (served, where it says so) this long has recovered: its backoff starts over


@dataclass
class Child:
    name: str                           # for the log: "the KV-cache manager", "the model service"
    argv: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    backoff_s: float = FIRST_BACKOFF_S
    exits: deque = field(default_factory=deque)   # when it exited, within the last minute
    _terminated: subprocess.Popen | None = None   # the process already sent SIGTERM
    hold_sighup: bool = False           # it re-reads keys on SIGHUP: one sent while it starts waits for it
    # A file the child touches once it serves (a model service's --ready-file): its run counts as
    # steady only STEADY_S after that, not after STEADY_S of loading a checkpoint.
    ready_path: Path | None = None
    ready_at: float | None = None       # when it was first seen (monotonic: a file's time is the wall clock's)
    unsteady: int = 0                   # exits in a row without a steady run
    restarts: int = 0                   # times started again after it exited (up's metrics serve it)

    def start(self) -> None:
        self.ready_at = None
        if self.ready_path is not None:
            self.ready_path.unlink(missing_ok=True)   # the last run's
        # Its own session: a terminal's Ctrl-C reaches only `up`, which stops the children in order.
        self.proc = subprocess.Popen(self.argv, start_new_session=True,
                                     preexec_fn=_before_exec(os.getpid(), self.hold_sighup))
        self.started_at = time.monotonic()

    def look_for_ready(self) -> None:
        """Notes when the child said it serves (up looks every 0.1 s)."""
        if self.ready_path is not None and self.ready_at is None and self.ready_path.exists():
            self.ready_at = time.monotonic()

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def exit_reason(self) -> str:
        code = self.proc.returncode
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def signal(self, signum: int) -> None:
        """Passes a signal on (SIGHUP: re-read the API keys), if the child runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def terminate(self) -> None:
        """SIGTERM, without waiting; once per process (stop() after terminate() sends none)."""
        if self.proc is not None and self.proc.poll() is None and self.proc is not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = self.proc

    def hurry(self) -> bool:
        """SIGINT to a child already sent SIGTERM and still draining: it stops now (a server's
        second signal, grpc_server.wait_for_signal). One not yet stopping is left alone: a
        SIGINT would be its first signal, a drain of its own. True when one was sent."""
        if self.proc is not None and self.proc is self._terminated and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            return True
        return False

    def stop(self, timeout_s: float) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`."""
        if self.proc is None:
            return
        self.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %g s of SIGTERM: killed", self.name, timeout_s)
            self.proc.kill()
            self.proc.wait()


class RestartLimit(Exception):
    """A child exited more often in a minute than the limit allows, or in a way a restart cannot
    mend; `exit_code` is the stack's (a child's EXIT_CANNOT_LISTEN or EXIT_BAD_FLAGS is passed on,
    as a supervisor above reads it: never restart)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def steady(child: Child, now: float) -> bool:
    """Whether the run that just ended had recovered: served STEADY_S where the child says when it
    serves, else ran that long."""
    if child.ready_path is None:
        return now - child.started_at > STEADY_S
    child.look_for_ready()   # (one not seen yet counts from now: not steady)
    return child.ready_at is not None and now - child.ready_at > STEADY_S


class Supervisor:
    def __init__(self, max_restarts_per_minute: int, stopping: Callable[[], bool]) -> None:
        self.max_restarts = max_restarts_per_minute
        self.stopping = stopping

    def restart(self, child: Child) -> None:
        """Starts an exited child again after its backoff. Raises RestartLimit."""
        now = time.monotonic()
        reason = child.exit_reason()
        if child.proc.returncode == EXIT_CANNOT_LISTEN:   # it would fail the same way again
            raise RestartLimit(f"{child.name} cannot listen on its address (in use, or not permitted; its "
                               "error is above); stopping the stack", EXIT_CANNOT_LISTEN)
        if child.proc.returncode == EXIT_BAD_FLAGS:   # so would a command line it refused
            raise RestartLimit(f"{child.name} refused the flags it was given (its error is above); stopping the "
                               "stack", EXIT_BAD_FLAGS)
        if steady(child, now):
            child.backoff_s, child.unsteady = FIRST_BACKOFF_S, 0
        else:
            child.unsteady += 1
        child.exits.append(now)
        while child.exits and now - child.exits[0] > 60:
            child.exits.popleft()
        if len(child.exits) > self.max_restarts:
            raise RestartLimit(f"{child.name} {reason}: {len(child.exits)} exits within a minute, more than "
                               f"--max-restarts {self.max_restarts} allows; stopping the stack")
        if child.unsteady > self.max_restarts:   # each run slower to fail than the minute's window sees
            raise RestartLimit(f"{child.name} {reason}: {child.unsteady} exits in a row without serving for "
                               f"{STEADY_S:g} s, more than --max-restarts {self.max_restarts} allows; stopping "
                               "the stack")
        log.warning("%s %s; starting it again in %.1f s (exit %d of at most %d a minute)",
                    child.name, reason, child.backoff_s, len(child.exits), self.max_restarts)
        self.sleep(child.backoff_s)
        child.backoff_s = min(child.backoff_s * 2, MAX_BACKOFF_S)
        if not self.stopping():
            child.restarts += 1
            child.start()

    def sleep(self, seconds: float) -> None:
        """Sleeps, waking early when the stack is stopping."""
        deadline = time.monotonic() + seconds
        while not self.stopping() and time.monotonic() < deadline:
            time.sleep(min(0.05, deadline - time.monotonic()))
