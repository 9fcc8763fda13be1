from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PreemptionMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREEMPTION_MODE_UNSPECIFIED: _ClassVar[PreemptionMode]
    PREEMPTION_MODE_RECOMPUTE: _ClassVar[PreemptionMode]
    PREEMPTION_MODE_SWAP: _ClassVar[PreemptionMode]

class SequenceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEQUENCE_STATE_UNSPECIFIED: _ClassVar[SequenceState]
    SEQUENCE_STATE_RUNNING: _ClassVar[SequenceState]
    SEQUENCE_STATE_SWAPPED: _ClassVar[SequenceState]
PREEMPTION_MODE_UNSPECIFIED: PreemptionMode
PREEMPTION_MODE_RECOMPUTE: PreemptionMode
PREEMPTION_MODE_SWAP: PreemptionMode
SEQUENCE_STATE_UNSPECIFIED: SequenceState
SEQUENCE_STATE_RUNNING: SequenceState
SEQUENCE_STATE_SWAPPED: SequenceState

class PageCopy(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class Grow(_message.Message):
    __slots__ = ("seq_id", "num_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class Admit(_message.Message):
    __slots__ = ("request_id", "token_ids", "extra_key", "max_tokens", "skip_prefix_hits")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    extra_key: str
    max_tokens: int
    skip_prefix_hits: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., extra_key: _Optional[str] = ..., max_tokens: _Optional[int] = ..., skip_prefix_hits: _Optional[bool] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("seq_id", "num_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class Fork(_message.Message):
    __slots__ = ("parent_seq_id", "request_id", "num_tokens")
    PARENT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    parent_seq_id: int
    request_id: str
    num_tokens: int
    def __init__(self, parent_seq_id: _Optional[int] = ..., request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class Need(_message.Message):
    __slots__ = ("grow", "admit", "resume", "fork")
    GROW_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    grow: Grow
    admit: Admit
    resume: Resume
    fork: Fork
    def __init__(self, grow: _Optional[_Union[Grow, _Mapping]] = ..., admit: _Optional[_Union[Admit, _Mapping]] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., fork: _Optional[_Union[Fork, _Mapping]] = ...) -> None: ...

class NeedResult(_message.Message):
    __slots__ = ("granted", "seq_id", "page_ids", "replaces_table", "cached_tokens", "num_tokens", "reason")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLACES_TABLE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    seq_id: int
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    replaces_table: bool
    cached_tokens: int
    num_tokens: int
    reason: str
    def __init__(self, granted: _Optional[bool] = ..., seq_id: _Optional[int] = ..., page_ids: _Optional[_Iterable[int]] = ..., replaces_table: _Optional[bool] = ..., cached_tokens: _Optional[int] = ..., num_tokens: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("seq_id", "num_computed", "token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_computed: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., num_computed: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Truncation(_message.Message):
    __slots__ = ("seq_id", "num_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class Slide(_message.Message):
    __slots__ = ("seq_id", "first_page", "end_page")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    END_PAGE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    first_page: int
    end_page: int
    def __init__(self, seq_id: _Optional[int] = ..., first_page: _Optional[int] = ..., end_page: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("epoch", "releases", "truncations", "commits", "needs", "preemption_mode", "slides")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATIONS_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    NEEDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_MODE_FIELD_NUMBER: _ClassVar[int]
    SLIDES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    releases: _containers.RepeatedScalarFieldContainer[int]
    truncations: _containers.RepeatedCompositeFieldContainer[Truncation]
    commits: _containers.RepeatedCompositeFieldContainer[Commit]
    needs: _containers.RepeatedCompositeFieldContainer[Need]
    preemption_mode: PreemptionMode
    slides: _containers.RepeatedCompositeFieldContainer[Slide]
    def __init__(self, epoch: _Optional[int] = ..., releases: _Optional[_Iterable[int]] = ..., truncations: _Optional[_Iterable[_Union[Truncation, _Mapping]]] = ..., commits: _Optional[_Iterable[_Union[Commit, _Mapping]]] = ..., needs: _Optional[_Iterable[_Union[Need, _Mapping]]] = ..., preemption_mode: _Optional[_Union[PreemptionMode, str]] = ..., slides: _Optional[_Iterable[_Union[Slide, _Mapping]]] = ...) -> None: ...

class Preemption(_message.Message):
    __slots__ = ("seq_id", "request_id", "mode")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    request_id: str
    mode: PreemptionMode
    def __init__(self, seq_id: _Optional[int] = ..., request_id: _Optional[str] = ..., mode: _Optional[_Union[PreemptionMode, str]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results", "preempted", "swap_out", "swap_in", "copies", "available_pages")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[NeedResult]
    preempted: _containers.RepeatedCompositeFieldContainer[Preemption]
    swap_out: _containers.RepeatedCompositeFieldContainer[PageCopy]
    swap_in: _containers.RepeatedCompositeFieldContainer[PageCopy]
    copies: _containers.RepeatedCompositeFieldContainer[PageCopy]
    available_pages: int
    def __init__(self, results: _Optional[_Iterable[_Union[NeedResult, _Mapping]]] = ..., preempted: _Optional[_Iterable[_Union[Preemption, _Mapping]]] = ..., swap_out: _Optional[_Iterable[_Union[PageCopy, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[PageCopy, _Mapping]]] = ..., copies: _Optional[_Iterable[_Union[PageCopy, _Mapping]]] = ..., available_pages: _Optional[int] = ...) -> None: ...

class SequenceRef(_message.Message):
    __slots__ = ("seq_id", "request_id")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    request_id: str
    def __init__(self, seq_id: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("epoch", "page_size", "num_pages", "instance", "cpu_pages")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    CPU_PAGES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    page_size: int
    num_pages: int
    instance: str
    cpu_pages: int
    def __init__(self, epoch: _Optional[int] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., instance: _Optional[str] = ..., cpu_pages: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("reset", "page_size", "num_pages", "cpu_pages", "max_seqs")
    RESET_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    CPU_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQS_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    page_size: int
    num_pages: int
    cpu_pages: int
    max_seqs: int
    def __init__(self, reset: _Optional[bool] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., cpu_pages: _Optional[int] = ..., max_seqs: _Optional[int] = ...) -> None: ...

class CanAllocateRequest(_message.Message):
    __slots__ = ("need",)
    NEED_FIELD_NUMBER: _ClassVar[int]
    need: Need
    def __init__(self, need: _Optional[_Union[Need, _Mapping]] = ...) -> None: ...

class CanAllocateResponse(_message.Message):
    __slots__ = ("ok", "pages_needed", "pages_available", "reason")
    OK_FIELD_NUMBER: _ClassVar[int]
    PAGES_NEEDED_FIELD_NUMBER: _ClassVar[int]
    PAGES_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    pages_needed: int
    pages_available: int
    reason: str
    def __init__(self, ok: _Optional[bool] = ..., pages_needed: _Optional[int] = ..., pages_available: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("need",)
    NEED_FIELD_NUMBER: _ClassVar[int]
    need: Need
    def __init__(self, need: _Optional[_Union[Need, _Mapping]] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("result", "swap_in", "copies")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    result: NeedResult
    swap_in: _containers.RepeatedCompositeFieldContainer[PageCopy]
    copies: _containers.RepeatedCompositeFieldContainer[PageCopy]
    def __init__(self, result: _Optional[_Union[NeedResult, _Mapping]] = ..., swap_in: _Optional[_Iterable[_Union[PageCopy, _Mapping]]] = ..., copies: _Optional[_Iterable[_Union[PageCopy, _Mapping]]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("commit",)
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    commit: Commit
    def __init__(self, commit: _Optional[_Union[Commit, _Mapping]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("pages_stored",)
    PAGES_STORED_FIELD_NUMBER: _ClassVar[int]
    pages_stored: int
    def __init__(self, pages_stored: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: SequenceRef
    def __init__(self, seq: _Optional[_Union[SequenceRef, _Mapping]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("pages_freed", "pages_cached")
    PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    pages_freed: int
    pages_cached: int
    def __init__(self, pages_freed: _Optional[int] = ..., pages_cached: _Optional[int] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("token_ids", "extra_key")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    extra_key: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., extra_key: _Optional[str] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("cached_tokens", "page_hashes")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    page_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cached_tokens: _Optional[int] = ..., page_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("parent", "request_id", "num_tokens")
    PARENT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    parent: SequenceRef
    request_id: str
    num_tokens: int
    def __init__(self, parent: _Optional[_Union[SequenceRef, _Mapping]] = ..., request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("seq_id", "page_ids", "copies")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    copies: _containers.RepeatedCompositeFieldContainer[PageCopy]
    def __init__(self, seq_id: _Optional[int] = ..., page_ids: _Optional[_Iterable[int]] = ..., copies: _Optional[_Iterable[_Union[PageCopy, _Mapping]]] = ...) -> None: ...

class TruncateRequest(_message.Message):
    __slots__ = ("seq", "num_tokens")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq: SequenceRef
    num_tokens: int
    def __init__(self, seq: _Optional[_Union[SequenceRef, _Mapping]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class TruncateResponse(_message.Message):
    __slots__ = ("page_ids", "pages_freed", "copies")
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    pages_freed: int
    copies: _containers.RepeatedCompositeFieldContainer[PageCopy]
    def __init__(self, page_ids: _Optional[_Iterable[int]] = ..., pages_freed: _Optional[int] = ..., copies: _Optional[_Iterable[_Union[PageCopy, _Mapping]]] = ...) -> None: ...

class SwapOutRequest(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: SequenceRef
    def __init__(self, seq: _Optional[_Union[SequenceRef, _Mapping]] = ...) -> None: ...

class SwapOutResponse(_message.Message):
    __slots__ = ("swap_out",)
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    swap_out: _containers.RepeatedCompositeFieldContainer[PageCopy]
    def __init__(self, swap_out: _Optional[_Iterable[_Union[PageCopy, _Mapping]]] = ...) -> None: ...

class SwapInRequest(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: SequenceRef
    def __init__(self, seq: _Optional[_Union[SequenceRef, _Mapping]] = ...) -> None: ...

class SwapInResponse(_message.Message):
    __slots__ = ("page_ids", "swap_in")
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    swap_in: _containers.RepeatedCompositeFieldContainer[PageCopy]
    def __init__(self, page_ids: _Optional[_Iterable[int]] = ..., swap_in: _Optional[_Iterable[_Union[PageCopy, _Mapping]]] = ...) -> None: ...

class GetSequenceRequest(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: SequenceRef
    def __init__(self, seq: _Optional[_Union[SequenceRef, _Mapping]] = ...) -> None: ...

class SequenceInfo(_message.Message):
    __slots__ = ("seq_id", "request_id", "state", "num_tokens", "num_computed", "page_ids", "cpu_page_ids", "cached_tokens", "extra_key")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    CPU_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    request_id: str
    state: SequenceState
    num_tokens: int
    num_computed: int
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    cpu_page_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: int
    extra_key: str
    def __init__(self, seq_id: _Optional[int] = ..., request_id: _Optional[str] = ..., state: _Optional[_Union[SequenceState, str]] = ..., num_tokens: _Optional[int] = ..., num_computed: _Optional[int] = ..., page_ids: _Optional[_Iterable[int]] = ..., cpu_page_ids: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[int] = ..., extra_key: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Stats(_message.Message):
    __slots__ = ("total_pages", "free_pages", "cached_pages", "used_pages", "num_sequences", "free_seq_ids", "cpu_total_pages", "cpu_free_pages", "prefix_query_tokens", "prefix_hit_tokens", "evictions", "preemptions_recompute", "preemptions_swap", "page_size", "max_seqs", "num_swapped", "epoch", "tree_pages", "last_event")
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FREE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    CPU_TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    CPU_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_SWAP_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_FIELD_NUMBER: _ClassVar[int]
    total_pages: int
    free_pages: int
    cached_pages: int
    used_pages: int
    num_sequences: int
    free_seq_ids: int
    cpu_total_pages: int
    cpu_free_pages: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int
    preemptions_recompute: int
    preemptions_swap: int
    page_size: int
    max_seqs: int
    num_swapped: int
    epoch: int
    tree_pages: int
    last_event: int
    def __init__(self, total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., cached_pages: _Optional[int] = ..., used_pages: _Optional[int] = ..., num_sequences: _Optional[int] = ..., free_seq_ids: _Optional[int] = ..., cpu_total_pages: _Optional[int] = ..., cpu_free_pages: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., evictions: _Optional[int] = ..., preemptions_recompute: _Optional[int] = ..., preemptions_swap: _Optional[int] = ..., page_size: _Optional[int] = ..., max_seqs: _Optional[int] = ..., num_swapped: _Optional[int] = ..., epoch: _Optional[int] = ..., tree_pages: _Optional[int] = ..., last_event: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("snapshot",)
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    def __init__(self, snapshot: _Optional[bool] = ...) -> None: ...

class StoredPage(_message.Message):
    __slots__ = ("hash", "parent_hash")
    HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    hash: int
    parent_hash: int
    def __init__(self, hash: _Optional[int] = ..., parent_hash: _Optional[int] = ...) -> None: ...

class PagesStored(_message.Message):
    __slots__ = ("parent_hash", "hashes")
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    parent_hash: int
    hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, parent_hash: _Optional[int] = ..., hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class PagesEvicted(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class CacheReset(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("hashes", "parent_hashes", "pages")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_hashes: _containers.RepeatedScalarFieldContainer[int]
    pages: _containers.RepeatedCompositeFieldContainer[StoredPage]
    def __init__(self, hashes: _Optional[_Iterable[int]] = ..., parent_hashes: _Optional[_Iterable[int]] = ..., pages: _Optional[_Iterable[_Union[StoredPage, _Mapping]]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("number", "epoch", "stored", "evicted", "reset", "snapshot")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    number: int
    epoch: int
    stored: PagesStored
    evicted: PagesEvicted
    reset: CacheReset
    snapshot: Snapshot
    def __init__(self, number: _Optional[int] = ..., epoch: _Optional[int] = ..., stored: _Optional[_Union[PagesStored, _Mapping]] = ..., evicted: _Optional[_Union[PagesEvicted, _Mapping]] = ..., reset: _Optional[_Union[CacheReset, _Mapping]] = ..., snapshot: _Optional[_Union[Snapshot, _Mapping]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
