"""Per-request output processing on the engine thread: detokenize, then stop checks."""

from __future__ import annotations

from kvserve.model_service.engine.request import Request
from kvserve.model_service.sampling.detokenizer import IncrementalDetokenizer
from kvserve.model_service.sampling.stop import StopChecker


class OutputProcessor:
    """Turns each sampled token into (text to stream, finished, reason, stop)."""

    def __init__(self, request: Request, tokenizer, eos_token_ids: frozenset[int]) -> None:
        p = request.params
        self.eos_token_ids = eos_token_ids
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_ids, p.skip_special_tokens)
        self.stop = StopChecker(p.stop, p.stop_token_ids, eos_token_ids, p.ignore_eos, request.max_tokens)

    def add(self, token: int, format_done: bool = False) -> tuple[str, bool, str | None, str | int | None]:
        """(text to stream, finished, reason, the stop string or stop token id that ended it).
        `format_done`: the token completes the request's structured output, which ends it "stop"
        unless a stop or the length ended it first; the text the stop check held back goes out,
        and an EOS that ended the format adds no text (even with ignore_eos)."""
        eos_ends_format = format_done and token in self.eos_token_ids
        result = self.stop.step(token, "" if eos_ends_format else self.detokenizer.add([token]))
        text = result.text
        if result.finished:
            if result.finish_reason == "length":
                text += self.detokenizer.flush()  # a cut-off character ends as U+FFFD, as a full decode would
            return text, True, result.finish_reason, result.stop_reason
        if format_done:
            return text + self.stop.end() + self.detokenizer.flush(), True, "stop", None
        return text, False, None, None
