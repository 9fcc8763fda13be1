"""The manager's core: plain Python, no torch, grpc or protobuf imports."""

from kvserve.kvcache_service.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KVCacheError,
    NotFound,
    ResourceExhausted,
)
from kvserve.kvcache_service.core.hashing import ROOT_HASH, page_hashes
from kvserve.kvcache_service.core.manager import KVCacheManager, ManagerConfig
from kvserve.kvcache_service.core.types import (
    Admit,
    Commit,
    Fork,
    Grow,
    NeedResult,
    PreemptionMode,
    Resume,
    StepPlan,
    StepRequest,
    Truncation,
)

__all__ = [
    "ROOT_HASH", "Admit", "AlreadyExists", "Commit", "FailedPrecondition", "Fork", "Grow",
    "InvalidArgument", "KVCacheError", "KVCacheManager", "ManagerConfig", "NeedResult",
    "NotFound", "PreemptionMode", "ResourceExhausted", "Resume", "StepPlan", "StepRequest",
    "Truncation", "page_hashes",
]
