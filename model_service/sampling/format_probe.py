"""A format's grammar checked by llguidance in a child process that is killed past a deadline.

llguidance's compile has no time bound: a small JSON Schema of a few hundred patternProperties
compiles for minutes of a core, and its parser limits do not bound that (docs/benchmarks.md). A
thread cannot be stopped, a process can: each new format is first checked here (the same compile,
without the vocabulary), and compiled in the server only once the check has ended in time. A
compile that crashes (a stack overflow on a chain of $refs) ends only the child.

The file is also the child: run by its path, it imports nothing of kvserve (nor torch).

    child -> parent   one byte once started (the deadline counts from then)
    parent -> child   4-byte big-endian length, the grammar (UTF-8)
    child -> parent   4-byte big-endian length, llguidance's error (UTF-8; empty: the grammar is fine)
"""

from __future__ import annotations

import os
import select
import struct
import subprocess
import sys
import threading
import time

CHILD_STACK_BYTES = 256 << 20   # as structured.COMPILE_STACK_BYTES: deep grammars recurse
START_S = 60.0                  # for the child to start (Python, llguidance's import), apart from a deadline
_LENGTH = struct.Struct(">I")
_READY = b"R"


class FormatTooSlow(ValueError):
    """The check ran past its deadline (the child was killed)."""


class FormatProbe:
    """One child at a time, started on first use and again after a kill; a lock makes concurrent
    checks take turns (formats compile on one lane anyway)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None

    def check(self, grammar: str) -> str:
        """llguidance's error for the grammar ("" if none); FormatTooSlow past the deadline,
        ValueError if the child died compiling it."""
        data = grammar.encode()
        with self._lock:
            try:
                child = self._started()
                deadline = time.monotonic() + self.timeout_s
                child.stdin.write(_LENGTH.pack(len(data)) + data)
                child.stdin.flush()
                size = _LENGTH.unpack(_read(child.stdout.fileno(), _LENGTH.size, deadline))[0]
                return _read(child.stdout.fileno(), size, deadline).decode(errors="replace")
            except TimeoutError:
                self._stop()
                raise FormatTooSlow(f"takes more than {self.timeout_s:g} s to compile "
                                    "(--format-compile-timeout)") from None
            except (OSError, EOFError):   # BrokenPipeError too: the child is gone
                self._stop()
                raise ValueError("could not be compiled: its compile crashed") from None
            except BaseException:   # the child may still answer later: never read out of step
                self._stop()
                raise

    def close(self) -> None:
        """Kills the child without waiting for a check under way (it then meets the end of the
        child's output): the caller may be an event loop."""
        child = self._child
        if child is not None:
            child.kill()

    def _started(self) -> subprocess.Popen:
        if self._child is None or self._child.poll() is not None:
            self._child = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            try:
                _read(self._child.stdout.fileno(), len(_READY), time.monotonic() + START_S)
            except (TimeoutError, EOFError):
                self._stop()
                raise ValueError("could not be checked: the process that compiles formats did not start") from None
        return self._child

    def _stop(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.wait()
            child.stdin.close()
            child.stdout.close()


def _read(fd: int, size: int, deadline: float) -> bytes:
    """Exactly `size` bytes from fd by the deadline: TimeoutError past it, EOFError at its end.
    (poll, not select: a server with thousands of connections has descriptors past select's 1024.)"""
    out = bytearray()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while len(out) < size:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise TimeoutError
        chunk = os.read(fd, size - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


def _serve() -> None:
    """The child: check grammars from stdin until it closes."""
    import llguidance

    threading.stack_size(CHILD_STACK_BYTES)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(_READY)
    stdout.flush()
    while True:
        head = stdin.read(_LENGTH.size)
        if len(head) < _LENGTH.size:
            return
        grammar = stdin.read(_LENGTH.unpack(head)[0]).decode()
        result: list[str] = []
        worker = threading.Thread(target=lambda: result.append(llguidance.LLMatcher.validate_grammar(grammar)))
        worker.start()
        worker.join()
        error = result[0].encode() if result else b"the compile failed"
        stdout.write(_LENGTH.pack(len(error)) + error)
        stdout.flush()


if __name__ == "__main__":
    _serve()
