"""Turns a request's output tokens into text incrementally, never half a UTF-8 character.

Decoding token by token and concatenating is wrong for two reasons: byte-level BPE splits one
character (CJK, emoji) over several tokens, each of which decodes alone to U+FFFD; and
SentencePiece-style decoders drop the leading space of the first token of every decode call.
So, as vLLM and TGI do, each step decodes a small window of tokens twice and emits the difference:

    tokens   [ ...prompt... | out0  out1  out2  out3 ]
                      ^prefix_offset     ^read_offset       (emitted text ends at read_offset)
    prefix_text = decode(tokens[prefix_offset:read_offset])
    new_text    = decode(tokens[prefix_offset:])
    emit new_text[len(prefix_text):] unless new_text ends with U+FFFD (an incomplete character:
    hold it, the next token may complete it); after emitting, both offsets move forward.

The window starts a few prompt tokens back so the first output token decodes in context (its
leading space survives). Offsets only move to points where the text decoded cleanly, so a window
never starts inside a character that the output completes.

A tail that ends in U+FFFD is held until a token completes it, but not without bound: a model
made to emit invalid bytes (a logit bias on a lone continuation byte will do it) would otherwise
re-decode an ever longer window every token, quadratic time on the engine thread. Past _MAX_HELD
held tokens, what can no longer change is written out (U+FFFD for each invalid sequence, as a
byte-level decode of the whole output shows it), and tokens that write nothing (skipped special
tokens) are dropped. `flush()` at the end of a request releases the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

# How many prompt tokens precede the first output token in the decode window (vLLM uses 5).
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"
# Output tokens held back before what of them can no longer change is written anyway: a character
# is at most 4 bytes, so only invalid bytes or tokens that write nothing are held this long.
_MAX_HELD = 16
_LONGEST_CHARACTER = 4   # UTF-8 bytes: tokens this far back from the end may still join a character


class Tokenizer(Protocol):
    """What is needed of a tokenizer: transformers' fast tokenizers and `tokenizers.Tokenizer`."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


# Where transformers' fast tokenizers define decode and _decode: a class that overrides either
# (a few rewrite the text) keeps its own path.
_TRANSFORMERS_BASES = ("transformers.tokenization_utils_base", "transformers.tokenization_utils_fast",
                       "transformers.tokenization_utils_tokenizers")


def decoder_of(tokenizer: Tokenizer) -> Callable[..., str]:
    """`tokenizer.decode`, or the Rust `tokenizers.Tokenizer.decode` underneath a transformers
    fast tokenizer where that gives the same text (transformers' own decode, no clean-up pass
    configured): it skips transformers' argument conversion, two thirds of a short window's decode
    (docs/benchmarks.md), and a stream decodes twice per token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False)
            or not all(_defined_in(type(tokenizer), name, _TRANSFORMERS_BASES) for name in ("decode", "_decode"))):
        return tokenizer.decode
    return backend.decode


# A Detokenize call's ids and the text it answers: under the 4 MiB a gRPC client receives by default.
MAX_DETOKENIZE_IDS = 1 << 17
MAX_DETOKENIZE_BYTES = 4_000_000


def check_detokenize_count(count: int) -> None:
    """Looked at before the ids are read (reading a repeated field builds a list of it)."""
    if count > MAX_DETOKENIZE_IDS:
        raise ValueError(f"{count:,} token ids; at most {MAX_DETOKENIZE_IDS:,} are written out in one call")


def detokenize(tokenizer: Tokenizer, ids: Sequence[int], vocab_size: int, skip_special_tokens: bool = False) -> str:
    """The text of `ids` as the tokenizer writes it, its own clean-up included: the text a stream of
    them or an echoed prompt shows. Ids past the tokenizer's own but within the model's
    `vocab_size` (its padding rows, which it can emit) write nothing. ValueError for an id past
    both, or a text over MAX_DETOKENIZE_BYTES. Run off the event loop: the Rust decode underneath
    a transformers tokenizer is called through decode_batch, which lets go of the GIL where
    decode does not."""
    ids = list(ids)
    size = max(len(tokenizer), vocab_size)
    bad = next((t for t in ids if not 0 <= t < size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {size})")
    decode = decoder_of(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and decode == backend.decode:
        text = backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
    else:
        text = decode(ids, skip_special_tokens=skip_special_tokens)
    if len(text) * 4 > MAX_DETOKENIZE_BYTES and (size := len(text.encode("utf-8"))) > MAX_DETOKENIZE_BYTES:
        raise ValueError(f"the text of these {len(ids):,} ids is {size:,} bytes; at most {MAX_DETOKENIZE_BYTES:,} "
                         "are answered in one call: ask for fewer ids")
    return text


def _defined_in(cls: type, name: str, modules: tuple[str, ...]) -> bool:
    owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
    return owner is not None and owner.__module__ in modules


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode_ids = decoder_of(tokenizer)
        self._skip_special = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = context       # window context + output ids, never trimmed below
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(0, len(context))

    def add(self, token_ids: Sequence[int]) -> str:
        """Append output tokens; return the text they complete (may be empty)."""
        self._ids.extend(token_ids)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) > len(self._prefix_text) and not new_text.endswith(_REPLACEMENT):
            return self._emit(new_text, len(self._ids))
        # nothing yet (a skipped special token) or an incomplete character
        return self._release_held(new_text) if len(self._ids) - self._read_offset > _MAX_HELD else ""

    def flush(self) -> str:
        """Release a held incomplete tail as U+FFFD, as decoding all output at once would."""
        new_text = self._decode(self._prefix_offset, len(self._ids))
        return self._emit(new_text, len(self._ids)) if len(new_text) > len(self._prefix_text) else ""

    def _release_held(self, whole: str) -> str:
        """Too many tokens held (`whole`: the window's text now). Tokens that wrote nothing are
        dropped; otherwise the text up to the last token boundary that is safe to write out: one
        where the text ends cleanly, or, among invalid bytes, one far enough back from the end
        that no later token can change the text before it."""
        if whole == self._prefix_text:   # nothing but tokens that write nothing
            del self._ids[self._read_offset:]
            return ""
        settled = self._settled()
        for end in range(len(self._ids) - 1, self._read_offset, -1):
            text = self._decode(self._prefix_offset, end)
            if len(text) > len(self._prefix_text) and (
                    not text.endswith(_REPLACEMENT) or (end <= settled and whole.startswith(text))):
                return self._emit(text, end)
        return ""

    def _settled(self) -> int:
        """The last token boundary with a character's worth of tokens that write something after
        it: no later token can join the bytes before it into a character. (Tokens that write
        nothing, skipped special ones, may sit between a character's bytes: counted, they let a
        lead byte go out as U+FFFD just before the bytes that complete it.) Past 4 x _MAX_HELD held
        tokens, a character's worth of any tokens: a character split by dozens of special tokens
        is no model's output, and the window must stay bounded."""
        writing = 0
        for i in range(len(self._ids) - 1, self._read_offset, -1):
            if self._decode(i, i + 1):
                writing += 1
                if writing == _LONGEST_CHARACTER:
                    return i
        if len(self._ids) - self._read_offset > 4 * _MAX_HELD:
            return len(self._ids) - _LONGEST_CHARACTER
        return self._read_offset

    def _emit(self, window_text: str, end: int) -> str:
        """Write the window's text up to token `end` beyond what was written, and move on to it."""
        delta = window_text[len(self._prefix_text):]
        self._advance(end)
        return delta

    def _advance(self, end: int) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = end
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        # Drop ids that no window will read again so `_ids` stays small.
        del self._ids[: self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._decode_ids(self._ids[start:end], skip_special_tokens=self._skip_special)
