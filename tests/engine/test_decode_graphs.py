"""DecodeGraphs' static buffers on CPU: everything a captured decode step does but the capture.

A step run through the static buffers (padded to a captured size, page tables W wide, the
padding's K/V in the spare page) must give the logits the eager runner gives for the same
step, write the same slots of every real sequence and no page but the spare one besides; and one
step's values must not leak into the next (the buffers are refilled, not appended to). The
backend here reads every per-step value from tensors, as flash-attn does; the graphs themselves
are checked on a GPU (tests/gpu/test_cuda_graphs.py).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvserve.model_service.attention.select import torch_attention
from kvserve.model_service.engine.decode_graphs import DecodeGraphs, capture_sizes, graph_safe
from kvserve.model_service.engine.request import Request
from kvserve.model_service.engine.runner import ModelRunner
from kvserve.model_service.engine.scheduler import Work
from kvserve.model_service.kv_cache import KVCache
from kvserve.model_service.model.loader import load_model
from kvserve.model_service.tiny_model import make_preset
from tests.engine.harness import EngineHarness, wait

PAGE = 4
MAX_LEN = 64


class TensorOnlyBackend:
    """Paged attention from tensors alone (no host-side lengths): each row attends over its
    table's pages, keys past its seq_len masked."""

    name = "tensor-only"
    graph_safe = True

    def prepare(self, batch):
        return batch

    def native_decode(self, meta):
        return None

    def decodes_natively(self) -> bool:
        return False

    def forward(self, q, k, v, k_cache, v_cache, batch, scale):
        hk, d = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, hk, d).index_copy_(0, batch.slot_mapping, k)
        v_cache.view(-1, hk, d).index_copy_(0, batch.slot_mapping, v)
        b, width = batch.block_tables.shape
        length = width * k_cache.shape[1]
        keys = k_cache[batch.block_tables.long()].reshape(b, length, hk, d)
        values = v_cache[batch.block_tables.long()].reshape(b, length, hk, d)
        group = q.shape[1] // hk
        keys, values = keys.repeat_interleave(group, 2), values.repeat_interleave(group, 2)
        visible = torch.arange(length) < batch.seq_lens[:, None]                         # (B, L)
        out = F.scaled_dot_product_attention(q[:, :, None],                              # (B, H, 1, D)
                                             keys.permute(0, 2, 1, 3), values.permute(0, 2, 1, 3),
                                             attn_mask=visible[:, None, None], scale=scale)
        return out[:, :, 0]                                                            # (B, H, D)


class DecodesFromTensors:
    """Decode-only steps through TensorOnlyBackend (as a graph would run them), every other step
    through the torch backend: an engine can serve with it."""

    name = "decodes-from-tensors"
    graph_safe = True

    def __init__(self) -> None:
        self.decodes, self.others = TensorOnlyBackend(), torch_attention()

    def prepare(self, batch):
        if batch.num_decodes == batch.num_seqs:
            return self.decodes, self.decodes.prepare(batch)
        return self.others, self.others.prepare(batch)

    def native_decode(self, meta):
        return None

    def decodes_natively(self) -> bool:
        return False

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        backend, inner = meta
        return backend.forward(q, k, v, k_cache, v_cache, inner, scale)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_preset(tmp_path_factory.mktemp("graphs") / "tiny", "tiny")
    model, config = load_model(path, torch.float32, torch.device("cpu"), "torch", small_linear=False)
    return model, config


def steps_of(rng: random.Random, vocab: int, lengths: list[int], pages: int, page_size: int = PAGE) -> list[Work]:
    """One decode per sequence: `n` tokens so far, the last one's K/V still to write; each on its
    own pages, drawn at random from `pages`."""
    free = list(range(pages))
    rng.shuffle(free)
    work = []
    for i, n in enumerate(lengths):
        r = Request(f"r{i}", [rng.randrange(3, vocab) for _ in range(n)], 8)
        r.page_table = [free.pop() for _ in range(-(-n // page_size))]
        work.append(Work(r, n - 1, 1))
    return work


def test_capture_sizes_cover_every_batch_up_to_the_largest() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(64)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(64)[-1] == 64
    sizes = capture_sizes(300)
    assert sizes == sorted(set(sizes)) and sizes[-1] == 300 and 256 in sizes and 288 in sizes
    assert not graph_safe(object()) and graph_safe(TensorOnlyBackend())


@pytest.mark.parametrize("lengths", [[1], [5, 9, 13], [4, 8, 1, 17, 30, 2, 63]], ids=["one", "three", "seven"])
def test_a_static_buffer_step_equals_the_eager_step(model, lengths) -> None:
    model, config = model
    rng = random.Random(len(lengths))
    pages = 40
    backend = TensorOnlyBackend()
    eager_cache = KVCache(config, pages, PAGE)
    graph_cache = KVCache(config, pages, PAGE, spare_page=True)
    noise = torch.randn_like(eager_cache.pool)   # stale bytes in every page: padding must not read them
    eager_cache.pool.copy_(noise)
    graph_cache.pool[:, :, :pages].copy_(noise)
    eager = ModelRunner(model, backend, eager_cache, PAGE, torch.device("cpu"))
    graphs = DecodeGraphs(model, backend, graph_cache, PAGE, 8, MAX_LEN, torch.device("cpu"), capture=False)
    runner = ModelRunner(model, backend, graph_cache, PAGE, torch.device("cpu"), graphs)

    for step in range(2):   # the second step's values replace the first's in the buffers
        work = steps_of(rng, config.vocab_size, [n + step for n in lengths], pages)
        expected = eager.execute(work)
        got = runner.execute(work)
        assert graphs.replays == step + 1
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        # The same slots written, and nothing else but the spare page.
        assert torch.allclose(graph_cache.pool[:, :, :pages], eager_cache.pool, rtol=1e-4, atol=1e-5)


def test_only_the_sampling_rows_come_back(model) -> None:
    model, config = model
    backend = TensorOnlyBackend()
    cache = KVCache(config, 16, PAGE, spare_page=True)
    graphs = DecodeGraphs(model, backend, cache, PAGE, 4, MAX_LEN, torch.device("cpu"), capture=False)
    work = steps_of(random.Random(1), config.vocab_size, [3, 6, 2], 16)
    middle = work[1].request
    work[1] = Work(middle, len(middle.tokens) - 2, 1)   # a row whose next token is already known
    assert not work[1].samples
    full = graphs.run(work)
    assert full.shape[0] == 2
    everything = graphs.logits[:3].clone()
    torch.testing.assert_close(full, everything[[0, 2]])


def test_steps_the_graphs_cannot_take_run_eagerly(model) -> None:
    model, config = model
    backend = TensorOnlyBackend()
    cache = KVCache(config, 40, PAGE, spare_page=True)
    graphs = DecodeGraphs(model, backend, cache, PAGE, 2, 16, torch.device("cpu"), capture=False)
    rng = random.Random(2)
    assert graphs.fits(steps_of(rng, config.vocab_size, [3, 16], 40))
    assert not graphs.fits(steps_of(rng, config.vocab_size, [3, 4, 5], 40))   # more than the largest size
    assert not graphs.fits(steps_of(rng, config.vocab_size, [17], 40))         # past the captured width
    prefill = steps_of(rng, config.vocab_size, [6], 40)
    prefill[0].count = 2
    assert not graphs.fits(prefill)
    with pytest.raises(ValueError, match="spare page"):
        DecodeGraphs(model, backend, KVCache(config, 4, PAGE), PAGE, 2, 16, torch.device("cpu"), capture=False)


def test_the_spare_page_is_not_the_managers(model) -> None:
    _, config = model
    cache = KVCache(config, 10, PAGE, spare_page=True)
    assert cache.num_pages == 10 and cache.spare_page == 10 and cache.pool.shape[2] == 11
    assert KVCache(config, 10, PAGE).spare_page is None


def test_an_engine_serving_decodes_from_static_buffers_gives_the_eager_tokens(tiny_dirs) -> None:
    """The engine's own steps (chunked prefill beside decodes, preemption in a small pool,
    requests finishing at different steps) with every decode-only step of up to 8 sequences run
    through DecodeGraphs' static buffers: the same greedy tokens as the same backend eagerly, and
    every page back at the end."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(3, 70))] for _ in range(12)]
    runs = {}
    for on in (False, True):
        h = EngineHarness(tiny_dirs["tiny"], page_size=PAGE, num_pages=80, max_num_seqs=8,
                          max_num_batched_tokens=48, attention_backend="torch", cpu_small_linear="off")
        try:
            old = h.engine.runner
            backend = DecodesFromTensors()
            cache = KVCache(h.stack.model_config, 80, PAGE, spare_page=True)
            graphs = DecodeGraphs(old.model, backend, cache, PAGE, 8, h.stack.max_model_len, old.device,
                                  capture=False) if on else None
            h.engine.runner = ModelRunner(old.model, backend, cache, PAGE, old.device, graphs)   # before any request
            outcomes = [h.submit(p, max_tokens=6 + 2 * i) for i, p in enumerate(prompts)]
            wait(outcomes)
            assert all(o.failure is None for o in outcomes), [o.failure for o in outcomes]
            runs[on] = [o.tokens for o in outcomes]
            assert h.stats().used_pages == 0
            if on:
                assert graphs.replays > 10   # most decode steps went through the buffers
        finally:
            h.close()
    assert runs[True] == runs[False]
