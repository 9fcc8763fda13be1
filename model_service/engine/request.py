"""The engine's record of one generation request."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.model_service.sampling.history import TokenHistory


class Status(enum.Enum):
    WAITING = "waiting"    # no pages (new, or preempted by recompute)
    RUNNING = "running"    # pages on the device
    SWAPPED = "swapped"    # private pages in the CPU pool
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int                  # effective: never past the model length
    params: Any = None               # sampling.SamplingParams
    extra_key: str = ""
    arrival: float = field(default_factory=time.monotonic)
    order: int = 0                   # place in line, set by the engine at submit
    tokens: list[int] = field(init=False)  # prompt + generated: what a re-admission prefills

    status: Status = Status.WAITING
    seq_id: int | None = None
    page_table: list[int] = field(default_factory=list)
    num_computed: int = 0            # tokens whose K/V are in the cache (or are being computed)
    pending: int = 0                 # 1 while the step that samples its next token runs
    told_computed: int = 0           # num_computed as the manager last heard it
    told_tokens: int = 0             # tokens the manager knows
    cached_tokens: int | None = None  # prefix-cache hit at the first admission
    aborted: bool = False
    finish_reason: str | None = None
    scheduled_at: float | None = None   # first admitted: the end of its time in the queue
    first_token_at: float | None = None
    unsent: list = field(default_factory=list)  # (token, text, logprobs) sampled, not yet streamed
    sink: Any = None                 # Callable[[Event], None], set by the engine's submit
    output: Any = None               # OutputProcessor: detokenizing, stop conditions
    generator: Any = None            # torch.Generator of a seeded request
    index: int = 0                   # which of its request's n sequences (family.py)
    family: Any = None               # family.Family when n > 1
    fork_at: int | None = None       # a parent computes no further until its children fork here
    draft_state: Any = None          # speculation.DraftState, with --speculative
    drafts_told: int = 0             # draft tokens the manager holds past told_tokens (truncated next step)
    draft_generators: list = field(default_factory=list)   # a seeded request's draws at draft positions
    slid_to: int = 0                 # sliding window: its pages before this one left it (but the sinks')
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprobs of prompt tokens 1.. so far, when asked
    matcher: Any = None              # structured output's grammar matcher (sampling/structured.py)
    forget_format: Any = None        # Callable[[], None]: its matcher failed, the compiled format is not kept
    continued: int = 0               # output tokens a continuation brought (generated elsewhere)
    queued_at_step: int = 0          # the engine's step count when it took the request in
    told_position: int | None = None  # its place in the queue as its stream last heard it (queue_positions.py)
    told_at: float = 0.0             # when it heard it
    history: TokenHistory | None = None   # a penalised request's tokens as a tensor, once sampled

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Asked for its prompt's logprobs and does not have them all yet (sequence 0 of a
        request of n takes them for all)."""
        params = self.params
        return (params is not None and params.prompt_logprobs is not None and self.index == 0
                and len(self.prompt_logprobs) < len(self.prompt_ids) - 1)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    def penalty_history(self) -> tuple[Any, Any]:
        """(prompt ids, output ids) as int64 tensors for its penalties, in time linear in the
        tokens added since the last call, not in the whole history."""
        if self.history is None:
            self.history = TokenHistory(len(self.prompt_ids))
        self.history.sync(self.tokens)
        return self.history.prompt, self.history.output

    @property
    def num_tokens(self) -> int:
        """Tokens including one being sampled: what the next step's plan must make room for."""
        return len(self.tokens) + self.pending

    @property
    def compute_end(self) -> int:
        """Tokens it may have computed by the end of the next step."""
        return self.num_tokens if self.fork_at is None else self.fork_at

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token is left to compute."""
        return self.num_computed == self.num_tokens - 1

    def forget_pages(self) -> None:
        """Preempted by recompute: everything goes again through admission."""
        self.seq_id = None
        self.page_table = []
        self.num_computed = self.told_computed = self.told_tokens = self.pending = self.drafts_told = 0
        self.slid_to = 0
        self.status = Status.WAITING
