"""build(): what the assembled stack serves, from the model's config and the options."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from tests.engine.harness import EngineHarness


def test_a_sliding_window_model_serves_its_whole_length_from_a_small_pool(tiny_dirs) -> None:
    # tiny-mistral: max_position_embeddings 2048, sliding_window 64; 40 pages hold 160 tokens
    h = EngineHarness(tiny_dirs["tiny-mistral"], page_size=4, num_pages=40)
    try:
        assert h.stack.max_model_len == 2048
        [outcome] = h.run([list(range(3, 503))], max_tokens=300)   # prefilled in chunks the pool holds
        assert outcome.finished.completion_tokens == 300
        assert h.stats().used_pages == 0
    finally:
        h.close()


@pytest.mark.parametrize("num_pages", [None, 64])   # sized from memory, or given
def test_cpu_start_runs_one_warm_up_step(tiny_dirs, caplog, num_pages) -> None:
    with caplog.at_level(logging.INFO, logger="kvserve.model_service.dummy_step"):
        h = EngineHarness(tiny_dirs["tiny"], page_size=4, max_num_batched_tokens=96, num_pages=num_pages)
    try:
        assert any("warm-up step of 96 tokens" in r.getMessage() for r in caplog.records)
        assert h.stats().used_pages == 0   # the warm-up used a scratch pool, not the served one
    finally:
        h.close()


def test_a_backend_named_that_cannot_run_here_is_a_config_error_naming_the_flag(tiny_dirs) -> None:
    """`kvserve model` turns a ValueError into one line; a RuntimeError was a traceback."""
    from kvserve.model_service.assembly import build
    from kvserve.model_service.config import ModelServiceConfig

    cfg = ModelServiceConfig(model=str(tiny_dirs["tiny"]), kvcache="inprocess", device="cpu", dtype="float16",
                             attention_backend="torch")
    # float16 is not the cpu kernel's (nor is a CPU without it): refused, naming the flag
    for backend, words in [("cpu", "--attention-backend cpu: "),
                           ("flash_attn", "--attention-backend flash_attn runs on CUDA only")]:
        with pytest.raises(ValueError, match=words):
            build(dataclasses.replace(cfg, attention_backend=backend))


def test_cuda_graphs_are_a_cuda_flash_attn_matter(tiny_dirs) -> None:
    """On CPU no step is captured and the pool has no spare page, whatever the flag says; a
    negative size is refused, naming the flag."""
    from kvserve.model_service.config import ModelServiceConfig

    h = EngineHarness(tiny_dirs["tiny"], page_size=4, num_pages=64, cuda_graph_max_batch=256)
    try:
        assert h.engine.runner.graphs is None and h.engine.runner.kv_cache.spare_page is None
    finally:
        h.close()
    with pytest.raises(ValueError, match="--cuda-graph-max-batch must be an integer >= 0"):
        ModelServiceConfig(cuda_graph_max_batch=-1)


def test_a_pool_that_cannot_be_allocated_is_a_sentence_and_no_sizing_is_written(tiny_dirs, tmp_path,
                                                                                monkeypatch) -> None:
    """It was a traceback after the sizing file was written, so `kvserve up` started a manager
    of that size and restarted the model service into the same failure."""
    from kvserve.model_service import assembly
    from kvserve.model_service.config import ModelServiceConfig

    def refuse(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 179 GB")

    monkeypatch.setattr(assembly, "KVCache", refuse)
    sizing = tmp_path / "sizing.json"
    cfg = ModelServiceConfig(model=str(tiny_dirs["tiny"]), kvcache="inprocess", device="cpu", num_pages=4096,
                             sizing_file=str(sizing))
    with pytest.raises(ValueError, match=r"cannot allocate the KV cache of 4096 pages .*can't allocate memory.*"
                                         r"give fewer \(--num-pages"):
        assembly.build(cfg)
    assert not sizing.exists()


def test_a_kv_cache_memory_that_holds_no_page_is_refused(tiny_dirs) -> None:
    """A budget under one page's bytes was served as one page: a 4-token pool, max_model_len 4."""
    from kvserve.model_service.assembly import build
    from kvserve.model_service.config import ModelServiceConfig

    cfg = ModelServiceConfig(model=str(tiny_dirs["tiny"]), kvcache="inprocess", device="cpu", page_size=4,
                             kv_cache_memory=1)
    with pytest.raises(ValueError, match=r"--kv-cache-memory 1 B holds no KV page: one page of 4 tokens "
                                         r"takes [\d,]+ bytes for this model"):
        build(cfg)


def test_a_kv_cache_memory_given_is_taken_whole_and_the_default_is_capped(tiny_dirs) -> None:
    """By default a CPU pool holds no more than --max-num-seqs full-length sequences fill; a
    --kv-cache-memory given was capped the same way, so more memory never cached more prefixes."""
    from kvserve.model_service import sizing
    from kvserve.model_service.kv_cache import bytes_per_page
    from kvserve.model_service.model.config import ModelConfig

    mcfg = ModelConfig.from_pretrained(tiny_dirs["tiny"])
    per_page = bytes_per_page(mcfg, torch.float32, 16)
    capped = 2 * -(-2048 // 16)
    assert sizing.cpu_pages(mcfg, torch.float32, 16, None, 2, 2048) == capped
    assert sizing.cpu_pages(mcfg, torch.float32, 16, 3 * capped * per_page, 2, 2048) == 3 * capped


def test_the_default_pool_of_a_sliding_window_model_is_one_it_can_start_with(tiny_dirs) -> None:
    """The default's cap (--max-num-seqs sequences of the model length) fell below what the window
    needs with one short sequence: the model service refused its own default at start."""
    h = EngineHarness(tiny_dirs["tiny-mistral"], page_size=4, max_num_seqs=1, max_model_len=100)
    try:
        assert h.stack.num_pages == 31 and h.stack.max_model_len == 100
        assert len(h.run([list(range(10, 90))], 10)[0].tokens) == 10
    finally:
        h.close()


def test_an_end_of_sequence_id_past_the_vocabulary_is_left_out_and_said(caplog) -> None:
    """A tokenizer's added EOS past the model's vocabulary was kept: a request's min_tokens
    masked it by indexing past the logits, and the whole batch failed INTERNAL."""
    from types import SimpleNamespace

    from kvserve.model_service.assembly import eos_ids_of
    from kvserve.model_service.sampling.params import SamplingParams
    from kvserve.model_service.sampling.sampler import Sampler
    mcfg = SimpleNamespace(eos_token_ids=[2, 1030], vocab_size=1024)
    with caplog.at_level(logging.WARNING):
        eos = eos_ids_of(mcfg, SimpleNamespace(eos_token_id=1029))
    assert eos == {2}
    assert "end-of-sequence ids [1029, 1030] are outside the model's vocabulary [0, 1024)" in caplog.text
    assert eos_ids_of(mcfg, SimpleNamespace(eos_token_id=None)) == {2}
    logits = torch.zeros(1, 1024)
    logits[0, 2] = 10.0
    out = Sampler(eos)(logits, [SamplingParams(temperature=0.0, min_tokens=3)], [[5]], [[]])
    assert out.token_ids[0] != 2


def test_long_prefill_token_threshold_bounds_a_prompts_chunk_and_changes_no_token(tiny_dirs) -> None:
    """--long-prefill-token-threshold is each prompt's chunk per step (the smaller of it and a
    sliding window's bound), and the tokens are those of whole-budget chunks."""
    prompts = [[(i * 7) % 900 + 3 for i in range(300)], [5, 6, 7, 8]]
    outputs = []
    for threshold in (0, 8):
        h = EngineHarness(tiny_dirs["tiny"], page_size=4, num_pages=256, max_num_batched_tokens=64,
                          long_prefill_token_threshold=threshold)
        try:
            assert h.engine.scheduler.config.max_chunk == (threshold or None)
            outputs.append([o.tokens for o in h.run(prompts, max_tokens=6, temperature=0.0, ignore_eos=True)])
        finally:
            h.close()
    assert outputs[0] == outputs[1] and all(len(t) == 6 for t in outputs[0])
    h = EngineHarness(tiny_dirs["tiny-mistral"], page_size=4, num_pages=40, long_prefill_token_threshold=1000)
    try:
        assert h.engine.scheduler.config.max_chunk < 1000   # the window's pool bounds it more
    finally:
        h.close()
