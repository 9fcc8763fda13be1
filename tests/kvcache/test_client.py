"""The manager's client, in-process: its answers and its errors reach the caller as the remote
client's do, where the answer is awaited."""

from __future__ import annotations

import pytest

from kvserve.kvcache_service.contract.client import InProcessKVClient
from kvserve.kvcache_service.contract.errors import FailedPrecondition
from kvserve.kvcache_service.contract.types import Admit, StepRequest
from kvserve.kvcache_service.core import KVCacheManager, ManagerConfig


def test_a_step_is_answered_where_it_is_awaited() -> None:
    client = InProcessKVClient(KVCacheManager(ManagerConfig(num_pages=8, page_size=4)))
    client.register(1, 4, 8)
    answer = client.send_step(StepRequest(1, needs=[Admit("a", [1, 2, 3])]))
    assert answer().results[0].page_ids == [0]
    assert client.stats().num_sequences == 1


def test_a_refused_step_raises_its_error_where_it_is_awaited() -> None:
    client = InProcessKVClient(KVCacheManager(ManagerConfig(num_pages=8, page_size=4)))
    client.register(1, 4, 8)
    answer = client.send_step(StepRequest(2))   # a stale epoch
    with pytest.raises(FailedPrecondition, match="stale epoch 2"):
        answer()
