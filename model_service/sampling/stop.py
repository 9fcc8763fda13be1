"""Decides when a request ends and which of its text may be streamed now.

Per token, in this order:
1. the token's text joins the held-back text; the earliest stop string in it that ends in the
   token's text (ties: the shortest) → finished "stop"; the text before it is released, the string
   and everything after dropped. Not within min_tokens (vLLM's rule): the first token whose text
   may complete a stop string is the (min_tokens + 1)-th; one completed earlier is streamed;
2. a stop token id, or EOS unless ignore_eos → finished "stop", all the text released. Such a
   token's own text is not output: its caller passes instead what earlier tokens' text the
   detokenizer still held (a character they left incomplete), which step 1 searched;
3. otherwise the longest tail that is a proper prefix of some stop string is held back (it may
   yet become a stop string) and the rest released;
4. the max_tokens-th token → finished "length" (unless 1–2 stopped it) with all text released.
   Its caller passes the detokenizer's last text with it (`is_last`), searched in step 1.

So the streamed text never contains a stop string or any part of one (but those completed within
min_tokens). Generation ends with the first token past min_tokens whose text completes a stop
string, and the streamed text is then exactly the output up to where the earliest stop string
ending in that token begins (a longer stop string that started earlier but had not completed does
not count: the request ended before it could).
A stop string can span any number of tokens: only text that might begin one is ever held, and
the search runs over held + new text, where any occurrence must start.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class StopResult:
    text: str                                # may be streamed now
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None     # the stop string or token id that ended it


class StopChecker:
    def __init__(
        self,
        stop_strings: Iterable[str] = (),
        stop_token_ids: Iterable[int] = (),
        eos_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        max_tokens: int | None = None,
        min_tokens: int = 0,
    ) -> None:
        self._stop_strings = tuple(stop_strings)
        if any(not s for s in self._stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._borders = [_borders(s) for s in self._stop_strings]
        self._states = [0] * len(self._stop_strings)   # per stop string: its longest prefix ending the text
        self._stop_ids = frozenset(stop_token_ids)
        self._eos_ids = frozenset() if ignore_eos else frozenset(eos_token_ids)
        self._max_tokens = max_tokens
        self._min_tokens = min_tokens
        self._held = ""
        self._num_tokens = 0
        self.finished = False

    @property
    def held_text(self) -> str:
        """Text not yet streamed because it may still begin a stop string."""
        return self._held

    def ends_by_id(self, token_id: int) -> bool:
        """The token is a stop token id or an EOS that counts: it ends the request, its text unsaid."""
        return token_id in self._stop_ids or token_id in self._eos_ids

    def is_last(self) -> bool:
        """The next token is the max_tokens-th: whatever text is held anywhere goes out with it."""
        return self._max_tokens is not None and self._num_tokens + 1 >= self._max_tokens

    def step(self, token_id: int, new_text: str) -> StopResult:
        """Account for one output token and the detokenizer's new text for it."""
        if self.finished:
            raise RuntimeError("StopChecker.step called after the request finished")
        self._num_tokens += 1
        text = self._held + new_text
        match = self._first_stop_string(text, len(self._held)) if self._num_tokens > self._min_tokens else None
        if match is not None:
            start, stop_string = match
            self._held = ""
            return self._finish(text[:start], "stop", stop_string)
        if self.ends_by_id(token_id):
            self._held = ""
            return self._finish(text, "stop", token_id)

        hold = self._advance(new_text)
        self._held = text[len(text) - hold:] if hold else ""
        ready = text[: len(text) - hold]
        if self._max_tokens is not None and self._num_tokens >= self._max_tokens:
            return self._finish(ready + self._release(), "length", None)
        return StopResult(ready)

    def end(self) -> str:
        """The request ends for a reason of its own (its structured output is complete): the
        text held back, which no stop string can now complete."""
        self.finished = True
        return self._release()

    def _finish(self, text: str, reason: FinishReason, stop: str | int | None) -> StopResult:
        self.finished = True
        return StopResult(text, True, reason, stop)

    def _release(self) -> str:
        text, self._held = self._held, ""
        return text

    def _first_stop_string(self, text: str, held: int) -> tuple[int, str] | None:
        """The earliest stop string in `text` that ends past its first `held` characters: held
        text may hold a whole one only where it completed within min_tokens, and was let go."""
        best: tuple[int, int, str] | None = None
        for s in self._stop_strings:
            start = text.find(s, max(0, held - len(s) + 1))
            if start >= 0 and (best is None or (start, len(s)) < best[:2]):
                best = (start, len(s), s)
        return None if best is None else (best[0], best[2])

    def _advance(self, new_text: str) -> int:
        """Runs each stop string's matcher over the new text: the length of the longest tail of
        the text so far that is a proper prefix of some stop string (held + new, where it lies).
        Knuth-Morris-Pratt, so a token costs its characters times the stop strings, however long
        they are; trying every tail length instead cost a token the square of their lengths
        (milliseconds for a request's 64 strings of 1,024 characters, on the engine thread)."""
        longest = 0
        for i, (s, borders) in enumerate(zip(self._stop_strings, self._borders)):
            state = self._states[i]
            for ch in new_text:
                while state and s[state] != ch:
                    state = borders[state - 1]
                if s[state] == ch:
                    state += 1
                if state == len(s):   # a whole stop string (step() found it first): go on from its border
                    state = borders[state - 1]
            self._states[i] = state
            longest = max(longest, state)
        return longest


@functools.lru_cache(maxsize=1024)
def _borders(s: str) -> tuple[int, ...]:
    """KMP's failure function of s: [i] is the length of the longest proper prefix of s[:i + 1]
    that is also its suffix. Cached: clients send the same stop strings again and again."""
    out = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = out[k - 1]
        if s[i] == s[k]:
            k += 1
        out[i] = k
    return tuple(out)
