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
        self.stop = StopChecker(p.stop, p.stop_token_ids, eos_token_ids, p.ignore_eos, request.max_tokens,
                                p.min_tokens)

    def add(self, token: int, format_done: bool = False) -> tuple[str, bool, str | None, str | int | None]:
        """(text to stream, finished, reason, the stop string or stop token id that ended it).
        `format_done`: the token completes the request's structured output, which ends it "stop"
        unless a stop or the length ended it first; the text the stop check held back goes out,
        and an EOS that ended the format adds no text (even with ignore_eos).
        Whatever ends the request, the text the detokenizer still holds (a character the output
        left incomplete: U+FFFD, as a whole decode gives it) goes out too, through the stop check."""
        if self.stop.ends_by_id(token) or (format_done and token in self.eos_token_ids):
            new_text = self.detokenizer.flush()   # not the token's own text: what came before it
        else:
            new_text = self.detokenizer.add([token])
            if format_done or self.stop.is_last():
                new_text += self.detokenizer.flush()
        result = self.stop.step(token, new_text)
        if result.finished:
            return result.text, True, result.finish_reason, result.stop_reason
        if format_done:
            return result.text + self.stop.end(), True, "stop", None
        return result.text, False, None, None
