"""Decode steps replayed from CUDA graphs (engine/decode_graphs.py) on the GPU, flash_attn backend.

- a replayed step's logits equal the eager step's within bfloat16 rounding, for batch sizes
  that are captured sizes and sizes padded up to one, step after step (each replay reads the
  buffers as refilled, nothing frozen at capture), and the same slots of the page pool are
  written, nothing else but the spare page;
- the model service captures them at start and serves from them.

Skipped without CUDA or without a flash-attn that pages on this GPU, as in CI.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.model_service.attention.flash_attn_backend import FlashAttnBackend, why_not_flash
from kvserve.model_service.engine.decode_graphs import DecodeGraphs
from kvserve.model_service.engine.runner import ModelRunner
from kvserve.model_service.kv_cache import KVCache
from kvserve.model_service.model.loader import load_model
from kvserve.model_service.tiny_model import make_preset
from tests.engine.harness import EngineHarness, wait
from tests.engine.test_decode_graphs import steps_of

WHY_NOT = why_not_flash()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

PAGE = 128
MAX_LEN = 2048
PAGES = 64 * MAX_LEN // PAGE   # the largest step's sequences, each up to MAX_LEN, on pages of their own


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_preset(tmp_path_factory.mktemp("graphs") / "tiny", "tiny")


def test_a_replayed_step_equals_the_eager_step(tiny) -> None:
    device = torch.device("cuda")
    model, config = load_model(tiny, torch.bfloat16, device)
    backend = FlashAttnBackend(device)
    eager_cache = KVCache(config, PAGES, PAGE, torch.bfloat16, device)
    graph_cache = KVCache(config, PAGES, PAGE, torch.bfloat16, device, spare_page=True)
    noise = torch.randn(eager_cache.pool.shape, generator=torch.Generator(device).manual_seed(3),
                        device=device).to(torch.bfloat16)   # every page's stale bytes: the context read
    eager_cache.pool.copy_(noise)
    graph_cache.pool[:, :, :PAGES].copy_(noise)
    eager = ModelRunner(model, backend, eager_cache, PAGE, device)
    graphs = DecodeGraphs(model, backend, graph_cache, PAGE, 64, MAX_LEN, device)
    graphs.capture()
    runner = ModelRunner(model, backend, graph_cache, PAGE, device, graphs)
    rng = random.Random(9)
    for n in (1, 3, 8, 13, 64, 5):   # captured sizes and padded ones, the largest, then a small one again
        lengths = [rng.randrange(1, MAX_LEN) for _ in range(n)]
        work = steps_of(rng, config.vocab_size, lengths, PAGES, PAGE)
        expected = eager.execute(work)
        got = runner.execute(work)
        torch.cuda.synchronize()
        assert got.shape == expected.shape
        # bf16 rounding (the padded batch's matmuls may sum in another order) moves logits by
        # hundredths; a wrong page table or a stale buffer moves them by the logits' own size.
        diff = (got - expected).abs()
        assert diff.max().item() <= 0.5 and diff.mean().item() <= 0.05, \
            f"{n} sequences: logits differ by {diff.max().item()} at most, {diff.mean().item()} on average"
        written = (graph_cache.pool[:, :, :PAGES].float() - eager_cache.pool.float()).abs().max().item()
        assert written <= 0.25, f"{n} sequences: the page pools differ by {written}"   # noise differs by ~1
    assert graphs.replays == 6


def test_the_model_service_serves_decode_steps_from_graphs(tiny) -> None:
    h = EngineHarness(tiny, device="cuda", dtype="bfloat16", attention_backend="flash_attn",
                      num_pages=256, max_num_seqs=16, cuda_graph_max_batch=8)
    try:
        graphs = h.engine.runner.graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
        rng = random.Random(4)
        # At most 8 at once: their decode steps fit the largest graph (a larger step runs eagerly).
        prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(1, 300))] for _ in range(6)]
        outcomes = [h.submit(p, max_tokens=5 + 3 * i) for i, p in enumerate(prompts)]
        wait(outcomes)
        assert [len(o.tokens) for o in outcomes] == [5 + 3 * i for i in range(6)]
        assert graphs.replays > 0
        assert h.stats().used_pages == 0   # every page back: nothing leaked through the padding
    finally:
        h.close()
    off = EngineHarness(tiny, device="cuda", dtype="bfloat16", attention_backend="flash_attn",
                        num_pages=256, cuda_graph_max_batch=0)
    try:
        assert off.engine.runner.graphs is None
    finally:
        off.close()
