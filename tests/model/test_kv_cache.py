"""KVCache: page copies between the device pool and the CPU swap space."""

from __future__ import annotations

import pytest
import torch

from kvserve.kvcache_service.contract.types import StepPlan
from kvserve.model_service.kv_cache import KVCache, bytes_per_page, bytes_per_token, pages_for_memory
from kvserve.model_service.model.config import ModelConfig


@pytest.fixture
def config(tiny_dirs) -> ModelConfig:
    return ModelConfig.from_pretrained(tiny_dirs["tiny"])


def fill_random(cache: KVCache) -> None:
    g = torch.Generator().manual_seed(0)
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=g))


def test_layout_matches_the_backend_interface(config: ModelConfig) -> None:
    cache = KVCache(config, num_pages=10, page_size=4, cpu_pages=3)
    assert len(cache.layers) == config.num_layers
    for k, v in cache.layers:
        assert k.shape == v.shape == (10, 4, config.num_kv_heads, config.head_dim)
        assert k.is_contiguous() and v.is_contiguous()
    assert cache.cpu_pool.shape[2:] == (3, 4, config.num_kv_heads, config.head_dim)
    # A layer's tensors are views of the pool: writes through them land in it.
    cache.layers[1][1][7].fill_(3.0)
    assert torch.all(cache.pool[1, 1, 7] == 3.0)


def test_swap_out_copy_swap_in_round_trip_preserves_bytes(config: ModelConfig) -> None:
    cache = KVCache(config, num_pages=12, page_size=4, cpu_pages=5)
    fill_random(cache)
    original = cache.pool.clone()

    cache.swap_out([(3, 4), (7, 0), (1, 2)])             # device -> cpu
    torch.testing.assert_close(cache.cpu_pool[:, :, [4, 0, 2]], original[:, :, [3, 7, 1]], rtol=0, atol=0)
    cache.pool[:, :, [3, 7, 1]] = 0                      # the device pages are reused meanwhile

    cache.swap_in([(4, 9), (0, 10), (2, 11)])            # cpu -> other device pages
    assert torch.equal(cache.pool[:, :, [9, 10, 11]], original[:, :, [3, 7, 1]])

    cache.copy([(9, 3), (10, 7)])                        # device -> device
    assert torch.equal(cache.pool[:, :, [3, 7]], original[:, :, [3, 7]])
    untouched = [0, 2, 4, 5, 6, 8]
    assert torch.equal(cache.pool[:, :, untouched], original[:, :, untouched])


def test_a_plan_runs_swap_out_then_copies_then_swap_in(config: ModelConfig) -> None:
    """One step's plan may swap a page out and hand the same device page to a copy and to a
    swap-in: each reads before the next overwrites (the manager's order)."""
    cache = KVCache(config, num_pages=6, page_size=2, cpu_pages=2)
    fill_random(cache)
    original, cpu = cache.pool.clone(), cache.cpu_pool.clone()
    cache.execute(StepPlan(swap_out=[(1, 0)], copies=[(2, 1)], swap_in=[(1, 2)]))
    assert torch.equal(cache.cpu_pool[:, :, 0], original[:, :, 1])    # page 1 saved before the copy
    assert torch.equal(cache.pool[:, :, 1], original[:, :, 2])        # then overwritten by it
    assert torch.equal(cache.pool[:, :, 2], cpu[:, :, 1])             # page 2 read, then swapped in


def test_empty_page_lists_are_no_ops(config: ModelConfig) -> None:
    cache = KVCache(config, num_pages=4, page_size=2, cpu_pages=0)
    cache.swap_out([])
    cache.swap_in([])
    cache.copy([])


def test_sizes(config: ModelConfig) -> None:
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    assert bytes_per_token(config, torch.float32) == per_token
    assert bytes_per_page(config, torch.bfloat16, 16) == 16 * per_token // 2
    page = bytes_per_page(config, torch.float32, 16)
    assert pages_for_memory(config, torch.float32, 16, 10 * page + page - 1) == 10
    assert pages_for_memory(config, torch.float32, 16, -5) == 0
    cache = KVCache(config, num_pages=10, page_size=16)
    assert cache.pool.numel() * cache.pool.element_size() == 10 * page


def test_bad_sizes_are_rejected(config: ModelConfig) -> None:
    with pytest.raises(ValueError):
        KVCache(config, num_pages=0, page_size=4)
    with pytest.raises(ValueError):
        KVCache(config, num_pages=4, page_size=4, cpu_pages=-1)


def test_chained_copies_run_in_list_order(config: ModelConfig) -> None:
    """The manager plans copies to run in order: (2 -> 5) then (5 -> 8) gives 8 page 2's bytes."""
    cache = KVCache(config, num_pages=10, page_size=4)
    fill_random(cache)
    original = cache.pool.clone()
    cache.copy([(2, 5), (5, 8)])
    torch.testing.assert_close(cache.pool[:, :, 8], original[:, :, 2], rtol=0, atol=0)
    torch.testing.assert_close(cache.pool[:, :, 5], original[:, :, 2], rtol=0, atol=0)


def test_a_page_written_twice_keeps_the_last_copy(config: ModelConfig) -> None:
    """index_copy_ leaves a page written twice in one batched copy undefined: such a list runs
    pair by pair, in order."""
    cache = KVCache(config, num_pages=10, page_size=4)
    fill_random(cache)
    original = cache.pool.clone()
    cache.copy([(1, 7), (2, 7), (3, 4)])
    torch.testing.assert_close(cache.pool[:, :, 7], original[:, :, 2], rtol=0, atol=0)
    torch.testing.assert_close(cache.pool[:, :, 4], original[:, :, 3], rtol=0, atol=0)
