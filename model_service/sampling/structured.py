"""Structured outputs: a request's output held to a format (a JSON Schema, any JSON object, a
regular expression, one of a list of strings, or a Lark grammar) by llguidance, the grammar engine
vLLM and SGLang use too. Before each sampled token the format's matcher gives the tokens that can
come next, and the sampler masks every other one; the sampled token goes into the matcher; the
request ends ("stop") when the format is complete and nothing can follow it (or at EOS, which the
mask allows once the output so far is complete).

JSON is compact (no free whitespace between tokens): a model, a small or random one above all, can
otherwise loop on whitespace for ever inside an object that stays valid.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.model_service.sampling.format_probe import FormatProbe, FormatTooSlow

if TYPE_CHECKING:
    import torch

FORMATS = ("json_schema", "json_object", "regex", "choice", "lark_grammar")
MAX_SPEC_CHARS = 256 << 10   # a schema or grammar, as text
# llguidance compiles recursively, a level for each rule or $ref a chain of them goes through:
# a 106 KB chain of $refs overflowed a thread's usual 8 MiB and killed the process (SIGSEGV).
# The chains that fit MAX_SPEC_CHARS compile in 64 MiB; a compile gets four times that, on a
# thread of its own (only the stack it touches takes memory, and only while it runs).
COMPILE_STACK_BYTES = 256 << 20
MAX_MESSAGE_CHARS = 500      # of llguidance's messages, which quote the grammar
# A format the probe stopped is refused at once this long: a load spike may have made it slow.
TOO_SLOW_FOR_S = 600.0


@dataclass(frozen=True, slots=True)
class Format:
    """What a request's output must be: `kind` one of FORMATS, `spec` its text (a choice list as
    JSON)."""
    kind: str
    spec: str

    def validate(self) -> None:
        """ValueError for what no grammar is needed to refuse."""
        if self.kind not in FORMATS:
            raise ValueError(f"structured output is one of {', '.join(FORMATS)}; got {self.kind!r}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"the {self.kind} has {len(self.spec):,} characters; at most {MAX_SPEC_CHARS:,} "
                             "are allowed")
        if self.kind in ("json_schema", "regex", "lark_grammar") and not self.spec:
            raise ValueError(f"the {self.kind} is empty")
        if self.kind == "choice":
            choices = json.loads(self.spec)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choice needs at least one choice, each a non-empty string")


def _grammar(llguidance, fmt: Format) -> str:
    """llguidance's grammar text for the format; ValueError naming what is wrong."""
    if fmt.kind in ("json_schema", "json_object"):
        text = fmt.spec if fmt.kind == "json_schema" else '{"type": "object"}'
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"json_schema is not JSON: {exc}") from None
        if schema is False:
            raise ValueError("json_schema false admits no JSON value")
        if schema is True:   # any value, as {} says it: with {}'s whitespace rule below
            schema = {}
        if not isinstance(schema, dict):
            raise ValueError("json_schema must be a JSON object (a schema)")
        options = schema.get("x-guidance")
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise ValueError("json_schema's x-guidance must be an object")
        options = dict(options)
        options.setdefault("whitespace_flexible", False)
        schema = {**schema, "x-guidance": options}
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    if fmt.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(fmt.spec)
    if fmt.kind == "choice":
        choices = json.loads(fmt.spec)
        return llguidance.grammar_from("lark", "start: " + " | ".join(json.dumps(c) for c in choices))
    return llguidance.grammar_from("lark", fmt.spec)


class Grammars:
    """One model's formats: its vocabulary as llguidance reads it (built once, on first use) and
    each format compiled once into a matcher that is only ever copied (clients send the same
    schema again and again; compiling one can take a fifth of a second, a copy microseconds)."""

    # Copies share their compiled format's lexer, which grows as outputs explore it (to 170 MB for
    # a hostile regex): a format whose matcher failed is dropped (forget), and few are kept.
    MAX_KEPT = 64

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, compile_timeout_s: float = 0) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self._lock = threading.Lock()   # requests are built on the tokenizer lanes' threads
        self._llg_tokenizer = None
        self._compiled: dict[tuple[str, Format], Any] = {}   # (tenant, format) -> its matcher at the start
        self._probe = FormatProbe(compile_timeout_s) if compile_timeout_s else None
        self._too_slow: dict[tuple[str, Format], float] = {}  # formats the probe stopped, when: refused at once

    def matcher(self, fmt: Format, tenant: str = "") -> Any:
        """A fresh matcher for the format; ValueError saying why the format cannot be used. Each
        tenant's formats are compiled and kept apart: how fast a format came would otherwise tell
        a tenant whether another had used it."""
        llguidance = _llguidance()
        with self._lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = _vocabulary(llguidance, self.tokenizer, self.vocab_size,
                                                  self.eos_token_ids or None)
            compiled = self._compiled.get((tenant, fmt))
            if compiled is not None:
                return compiled.deep_copy()
            stopped = self._too_slow.get((tenant, fmt))
            if stopped is not None and time.monotonic() - stopped < TOO_SLOW_FOR_S:
                raise ValueError(f"the {fmt.kind} took too long to compile before; it is not tried again for a while")
        try:
            compiled = _on_deep_stack(self._compile, llguidance, fmt)
        except FormatTooSlow:
            with self._lock:
                if len(self._too_slow) >= self.MAX_KEPT:
                    self._too_slow.pop(next(iter(self._too_slow)))
                self._too_slow[(tenant, fmt)] = time.monotonic()
            raise
        with self._lock:
            if len(self._compiled) >= self.MAX_KEPT:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[(tenant, fmt)] = compiled
            return compiled.deep_copy()

    def forget(self, fmt: Format, tenant: str = "") -> None:
        """A request's matcher of this format failed as it generated (a limit of llguidance's
        met): the compiled format, whose lexer grew with it, is not kept."""
        with self._lock:
            self._compiled.pop((tenant, fmt), None)

    def close(self) -> None:
        """Ends the probe's child, if one runs."""
        if self._probe is not None:
            self._probe.close()

    def _compile(self, llguidance, fmt: Format) -> Any:
        try:
            grammar = _grammar(llguidance, fmt)
        except RecursionError:   # Python's json, reading or writing a schema thousands of levels deep
            raise ValueError(f"the {fmt.kind} nests too deeply") from None
        if self._probe is not None:   # the same compile first in a child that a deadline can stop
            # (a format compiles twice then: once a tenant, the server's copy kept and copied after)
            try:
                error = self._probe.check(grammar)
            except FormatTooSlow as exc:
                raise FormatTooSlow(f"the {fmt.kind} {exc}") from None
            except ValueError as exc:
                raise ValueError(f"the {fmt.kind} {exc}") from None
            if error:
                raise ValueError(f"the {fmt.kind} cannot be used: {first_lines(error)}")
        compiled = llguidance.LLMatcher(self._llg_tokenizer, grammar)
        if compiled.is_error():
            raise ValueError(f"the {fmt.kind} cannot be used: {first_lines(compiled.get_error())}")
        import llguidance.torch as llg_torch

        first = llg_torch.allocate_token_bitmask(1, self.vocab_size)   # a format no output can begin
        llg_torch.fill_next_token_bitmask(compiled, first, 0)          # fails only at its first mask
        if compiled.is_error() or not first.any():
            why = f" (llguidance: {first_lines(compiled.get_error())})" if compiled.is_error() else ""
            raise ValueError(f"the {fmt.kind} allows no output, not even an empty one{why}")
        return compiled


_deep_stack_lock = threading.Lock()


def _on_deep_stack(fn, *args) -> Any:
    """fn(*args) on a thread of its own with COMPILE_STACK_BYTES of stack; its result, or what it
    raised."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:   # re-raised in the caller's thread
            outcome["error"] = exc

    with _deep_stack_lock:   # the size is the process's for threads started meanwhile
        before = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="kvserve-format-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(before)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _vocabulary(llguidance, tokenizer, vocab_size: int, eos_token_ids) -> Any:
    """The model's vocabulary as llguidance reads it, where a format's literal text is only text.
    Built from the tokenizer's JSON alone, llguidance tokenized a forced "<s>" or "</s>" (an HTML
    tag; Qwen's "<think>") as the special token, then refused that very token as output: the
    request failed mid-stream. Here every special token keeps its id and its place in the masks,
    and text is tokenized as before, except that a special token's spelling inside it is spelled
    out in ordinary tokens."""
    import llguidance.hf

    base = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids)
    spelled = {i: tokenizer.convert_ids_to_tokens(i) or "" for i in range(base.vocab_size)
               if base.is_special_token(i)}
    if not any(spelled.values()):
        return base
    splitter = re.compile("(" + "|".join(map(re.escape, sorted(filter(None, set(spelled.values())),
                                                                key=len, reverse=True))) + ")")
    tokens = [spelled[i].encode() if i in spelled else base.decode_bytes([i]) for i in range(base.vocab_size)]

    class Tokens:   # what llguidance.TokenizerWrapper reads
        eos_token_id = tokenizer.eos_token_id
        bos_token_id = tokenizer.bos_token_id
        special_token_ids = list(spelled)

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: str | bytes) -> list[int]:
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            ids: list[int] = []
            for k, piece in enumerate(splitter.split(text)):   # odd pieces: a special token's spelling
                if piece:
                    ids += base.greedy_tokenize(piece) if k % 2 else base.tokenize_str(piece)
            return ids

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tokens()), n_vocab=vocab_size,
                                  eos_token=eos_token_ids)


def mask_rows(logits: torch.Tensor, rows: list[int], matchers: list) -> None:
    """In place: row rows[i] of `logits` keeps only the tokens matchers[i] allows next. The
    matchers write a bitmask (a bit per token, 32 to an int32); numpy unpacks it and each row is
    filled through a view. (llguidance's own apply is TorchScript: seconds to compile at its first
    call, and slower on CPU than this.)"""
    import llguidance.torch as llg_torch
    import numpy as np
    import torch

    vocab = logits.shape[1]
    bitmask = llg_torch.allocate_token_bitmask(len(rows), vocab)                   # (R, ceil(V / 32)) int32
    if len(matchers) > 1:   # llguidance's threads, while the model's are idle between forward and sampling
        llg_torch.fill_next_token_bitmask_par(_executor(), [(m, i) for i, m in enumerate(matchers)], bitmask)
    else:
        llg_torch.fill_next_token_bitmask(matchers[0], bitmask, 0)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]   # (R, V)
    if logits.device.type == "cpu":   # numpy's one thread: torch's would wake its pool between the model's
        x = logits.numpy()            # kernels and the sampler's argmax, and the two pools contend (ms)
        for i, row in enumerate(rows):
            x[row][bits[i] == 0] = -np.inf
        return
    banned = torch.from_numpy(bits == 0).to(logits.device)
    for i, row in enumerate(rows):
        logits[row].masked_fill_(banned[i], float("-inf"))


@functools.cache
def _executor():
    import llguidance

    return llguidance.LLExecutor()


def _llguidance():
    try:
        import llguidance
    except ImportError:   # a dependency of the package; an install without it cannot constrain output
        raise ValueError("structured output needs the llguidance package, which this server lacks") from None
    return llguidance


def first_lines(text: str, lines: int = 3) -> str:
    """An llguidance message, short enough for a status: its first lines, at most
    MAX_MESSAGE_CHARS (its messages quote the grammar, which may be 256 KiB)."""
    short = " ".join(line.strip() for line in text.strip().splitlines()[:lines])
    return short if len(short) <= MAX_MESSAGE_CHARS else short[:MAX_MESSAGE_CHARS - 1] + "…"
