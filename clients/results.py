"""What the Python SDK returns: plain frozen dataclasses, converted from protobuf at the edge
(inference_client.py), and the one error type every failed call raises."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

import grpc

from kvserve.kvcache_service.contract.types import Stats
from kvserve.services.plumbing.retry_hints import retry_after_ms, says_no_retry


# --------------------------------------------------------------------------- errors

# Failures a later try may not meet: the server busy, away, or in its drain.
TRANSIENT = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED", "ABORTED"})


class KVServeError(Exception):
    """A call failed; code is the gRPC status name, e.g. "INVALID_ARGUMENT". What the server said
    of trying again: `retry_after_ms`, its hint (a full queue: RESOURCE_EXHAUSTED), or None; and
    `retryable`: the failure is a transient one (TRANSIENT) and the server did not forbid a retry
    (one that two workers died computing could kill more)."""

    def __init__(self, code: str, message: str, retry_after_ms: int | None = None, no_retry: bool = False) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.retryable = code in TRANSIENT and not no_retry

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    @classmethod
    def from_rpc_error(cls, exc: grpc.RpcError) -> KVServeError:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else None
        if code == grpc.StatusCode.UNAVAILABLE and details and "ping timeout" in details:
            details = ("the server stopped answering: a keepalive ping got no reply (the server is "
                       "frozen, or the network to it is gone)")
        name = code.name if code is not None else "UNKNOWN"
        trailers = (exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None) or ()
        # (a status without details: a sentence, not the grpc error's multi-line repr)
        return cls(name, details or f"the server ended the call {name} without saying why",
                   retry_after_ms(trailers), says_no_retry(trailers))


# --------------------------------------------------------------------------- events

@dataclass(frozen=True, slots=True)
class Queued:
    """The request waits: in a gateway's queue for a worker, or in a model service's queue for
    room (position 0: it left that queue; its prompt is being computed)."""
    position: int  # 1 = next
    eta_ms: int    # 0: no estimate


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    logprob: float
    token: str = ""  # the token alone as text
    token_bytes: bytes = b""  # what it stands for, part of a UTF-8 character too (b"": not known)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()  # most likely first
    token: str = ""  # the token alone as text
    token_bytes: bytes = b""  # what it stands for, part of a UTF-8 character too (b"": not known)


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The prompt's own logprobs (generate's prompt_logprobs): each token's given the ones before it."""
    first_token_id: int                # the first prompt token, which has nothing before it
    first_token: str
    tokens: tuple[TokenLogprob, ...]   # one per prompt token after the first
    text: str                          # the prompt decoded whole


@dataclass(frozen=True, slots=True)
class PrefillDone:
    request_id: str
    prompt_tokens: int
    cached_tokens: int  # served from the prefix cache
    prompt_logprobs: PromptLogprobs | None = None  # when asked for


@dataclass(frozen=True, slots=True)
class Chunk:
    token_ids: tuple[int, ...]
    text: str  # incremental
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token when asked for
    index: int = 0  # which of the request's n sequences


@dataclass(frozen=True, slots=True)
class Finished:
    reason: str  # "stop" | "length" | "abort" ("unspecified" if the server sent none; "reason_N" for one newer than this SDK)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_ms: float
    total_ms: float
    stop: str = ""                     # the stop string that ended it
    stop_token_id: int | None = None   # or the stop token / EOS
    index: int = 0                     # which of the request's n sequences


Event = Union[Queued, PrefillDone, Chunk, Finished]


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    finished: Finished
    prefill: PrefillDone | None  # None only if the server never sent prefill_done
    logprobs: tuple[TokenLogprob, ...] = ()
    # With n > 1: every sequence's Completion, in index order (this one is the first); else ().
    choices: tuple[Completion, ...] = ()

    @property
    def request_id(self) -> str:
        return self.prefill.request_id if self.prefill else ""


# --------------------------------------------------------------------------- unary results

@dataclass(frozen=True, slots=True)
class Tokenized:
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    page_size: int
    dtype: str
    attention_backend: str
    device: str
    num_pages: int
    eos_token_ids: tuple[int, ...]
    cpu_gemm: str = ""     # native | onednn | torch; empty from a server older than the field
    extra_key_digest: str = ""  # names the extra_key (--cache-salt) the worker hashes pages with
    max_num_seqs: int = 0
    kv_cache_dtype: str = ""    # the KV pages' dtype (--kv-cache-dtype); empty from a server older than the field
    trusts_tenant_metadata: bool = False   # takes a trusted front's tenant (--trust-tenant-metadata)
    attention_sink: int = 0     # tokens kept for a stream past the model length (--attention-sink)
    max_waiting: int = 0        # requests it keeps waiting before refusing more (--max-waiting)
    sliding_window: int = 0     # tokens a query attends back (a sliding-window model); 0: all
    tokenizer_digest: str = ""  # what its tokenizer does, as 16 hex digits (a gateway compares them)
    takes_cache_salt: bool = False   # it keeps a request's cache_salt (older versions ignore it)
    config_digest: str = ""     # its model's shape, as 16 hex digits (a gateway compares them)
    lane_address: str = ""      # where it serves Generate to a gateway over the lane (--lane-listen); "": nowhere
    lane_pings: bool = False    # its lane reads a gateway's pings while a call runs (lane.proto)


# kvserve.kvcache.v1.Stats, as the model service reports it: the manager's own type.
KVCacheStats = Stats


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One worker as a gateway sees it."""
    address: str
    state: str                # starting | serving | not serving | down
    running: int
    waiting: int
    used_pages: int
    free_pages: int
    cached_pages: int
    requests_routed: int
    hit_tokens: int           # prompt tokens of routed requests found in its cache
    prompt_tokens: int
    epoch: int
    events_live: bool
    index_pages: int
    migrated_away: int
    not_serving: str = ""     # why it takes no requests, when its state is "not serving" or "down"
    lane: str = ""            # where the gateway reaches its Generate over the lane; "": over gRPC
    prefill_tokens: int = 0   # prompt tokens to compute there before a new request's, as the gateway reckons it


@dataclass(frozen=True, slots=True)
class ServerStats:
    running: int
    waiting: int
    swapped: int
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int
    requests_finished: int
    requests_aborted: int
    steps: int
    kvcache: KVCacheStats | None = None
    # Seconds the engine spent in each phase of its steps since start.
    schedule_seconds: float = 0.0  # building the step's needs, applying the answer
    manager_seconds: float = 0.0   # the Step round trip to the KV-cache manager
    copy_seconds: float = 0.0      # swap and copy-on-write page copies
    forward_seconds: float = 0.0   # batch tensors + the model's forward pass
    sample_seconds: float = 0.0
    emit_seconds: float = 0.0      # detokenizing, stop checks, handing events to streams
    requests_failed: int = 0       # ended with an error status (UNAVAILABLE, INTERNAL)
    manager_losses: int = 0        # times the KV-cache manager went away and requests were re-admitted
    manager_reachable: bool = True  # false while the engine waits for its manager (kvcache is then None)
    workers: tuple[WorkerStats, ...] = ()  # a gateway's workers (empty from a model service)
    queued: int = 0                # requests waiting in a gateway's queue
    serving: bool = True           # takes new requests now (a gateway: while a worker does)
    not_serving: str = ""          # why not, when serving is false
    gateway: bool = False          # a gateway's answer (it may have no workers yet)
    prefill_tokens: int = 0        # tokens its running sequences have yet to prefill (a gateway: its workers' sum)


# A chat message: {"role": ..., "content": ...} (and an optional "name", the speaker's), a
# (role, content) pair, or any object with .role and .content (and optionally .name).
Message = Union[Mapping[str, str], tuple[str, str], Any]
