#!/usr/bin/env python
"""What checking stop strings costs per token, on the engine thread: the StopChecker against the
tail search it replaced (every tail length tried for every stop string, each a slice and an
endswith), in one run.

    .venv/bin/python bench/stop_strings.py

Three cases: no stop strings; two short ones (a chat's); and the worst a client may send within
the limits (--max-stop-strings 64 strings of 1,024 characters: 63 that never match and one that
is the output's first 1,023 characters and a character it never writes, so the output matches
ever more of it and never all). 3 characters a token, 340 tokens.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.model_service.sampling.stop import StopChecker  # noqa: E402


def tail_search(text: str, stops: tuple[str, ...]) -> int:
    """The replaced search: the longest tail of text that is a proper prefix of a stop string."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


class TailSearchChecker(StopChecker):
    """The StopChecker as it was: the same step, with the tail search for what to hold."""

    def _advance(self, new_text: str) -> int:
        return tail_search(self._held + new_text, self._stop_strings)


def per_token(stops: list[str], chunks: list[str], kind: type[StopChecker]) -> float:
    """Seconds a token, best of 5 passes over the chunks."""
    best = float("inf")
    for _ in range(5):
        checker = kind(stop_strings=stops)
        start = time.perf_counter()
        for chunk in chunks:
            checker.step(5, chunk)
        best = min(best, (time.perf_counter() - start) / len(chunks))
    return best


def main() -> None:
    rng = random.Random(1)
    out = "".join(rng.choice("abcdefgh ") for _ in range(1020))
    chunks = [out[i:i + 3] for i in range(0, len(out), 3)]
    cases = {
        "none": [],
        "two short": ["\n\n", "User:"],
        "64 x 1,024 characters, one matching ever more": [
            "".join(rng.choice("xyz") for _ in range(1024)) for _ in range(63)] + [out[:1023] + "\x01"],
    }
    print(f"{'stop strings':<48} {'StopChecker':>12} {'tail search':>12} {'ratio':>7}")
    for name, stops in cases.items():
        ours, peer = per_token(stops, chunks, StopChecker), per_token(stops, chunks, TailSearchChecker)
        print(f"{name:<48} {ours * 1e6:>9.1f} us {peer * 1e6:>9.1f} us {peer / ours:>6.1f}x")


if __name__ == "__main__":
    main()
