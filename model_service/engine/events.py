"""What the engine tells a request's listener, in order: Queued... (only when it waits),
PrefillDone, Tokens..., Finished.

Plain data, made on the engine thread and handed to the listener's sink,
which must not block (the servicer's sink hops onto its asyncio loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.model_service.engine.errors import RequestFailed


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    prompt_ids: list[int]   # the first has no logprob
    tokens: list            # TokenLogprobs of the prompt's tokens after the first


@dataclass(frozen=True, slots=True)
class Queued:
    """Its place in the worker's queue (1 = next), or 0: it left the queue, its prompt is being
    computed (queue_positions.py)."""
    position: int
    eta_ms: int   # 0: no estimate


@dataclass(frozen=True, slots=True)
class PrefillDone:
    prompt_tokens: int
    cached_tokens: int
    prompt_logprobs: PromptLogprobs | None = None   # when the request asked for them


@dataclass(frozen=True, slots=True)
class Tokens:
    token_ids: list[int]
    text: str
    logprobs: list = field(default_factory=list)  # sampling TokenLogprobs, one per token when asked
    index: int = 0                                # which of the request's n sequences
    at: float = 0.0                               # time.monotonic() when the engine sent it


@dataclass(frozen=True, slots=True)
class Finished:
    reason: str          # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_ms: float
    total_ms: float
    stop: str = ""                     # the stop string that ended it
    stop_token_id: int | None = None   # or the stop token / EOS
    queue_ms: float = 0.0              # arrival to first admitted
    index: int = 0                     # which of the request's n sequences


@dataclass(frozen=True, slots=True)
class Failed:
    """The engine could not complete the request; the stream ends with the error's status
    (errors.py: Unavailable when the manager stays lost or the server stops, InternalError)."""
    error: RequestFailed

    @property
    def message(self) -> str:
        return str(self.error)


Event = Queued | PrefillDone | Tokens | Finished | Failed
