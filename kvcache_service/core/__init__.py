"""The manager's core: plain Python, no torch, grpc or protobuf imports.

KVCacheManager (manager.py) is its API; the types it takes and returns are the manager's
contract (kvserve.kvcache_service.contract.types), re-exported here for convenience.
"""

from kvserve.kvcache_service.contract.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KVCacheError,
    NotFound,
    ResourceExhausted,
)
from kvserve.kvcache_service.contract.hashing import ROOT_HASH, page_hashes
from kvserve.kvcache_service.contract.types import (
    Admit,
    Commit,
    Fork,
    Grow,
    NeedResult,
    PreemptionMode,
    Resume,
    Slide,
    StepPlan,
    StepRequest,
    Truncation,
)
from kvserve.kvcache_service.core.config import ManagerConfig
from kvserve.kvcache_service.core.manager import KVCacheManager

__all__ = [
    "ROOT_HASH", "Admit", "AlreadyExists", "Commit", "FailedPrecondition", "Fork", "Grow",
    "InvalidArgument", "KVCacheError", "KVCacheManager", "ManagerConfig", "NeedResult",
    "NotFound", "PreemptionMode", "ResourceExhausted", "Resume", "Slide", "StepPlan", "StepRequest",
    "Truncation", "page_hashes",
]
