"""The fused decode layer (kernels/decode_layer.c): a decode step of a few rows through each
layer in one native call equals the same step module by module (logits and the K/V written),
on every tiny architecture (biases, q/k norms, tied heads), at one and several threads, in
float32 and in bfloat16 (rounded where the modules round); and it refuses what it cannot take.
Greedy equality with transformers through it is test_equivalence.py's, whose cpu-backend decode
steps take this path."""

from __future__ import annotations

import pytest
import torch

from kvserve.model_service.attention.select import select_backend, torch_attention
from kvserve.model_service.batch import ForwardBatch
from kvserve.model_service.kernels import decode_layer
from kvserve.model_service.kv_cache import KVCache
from kvserve.model_service.model.loader import load_model
from tests.conftest import ARCH_PRESETS
from tests.model.conftest import Loaded
from tests.model.native_kernels import load_at_level, runnable_levels, torch_threads

PAGE = 4
PAGES = 160


@pytest.fixture(scope="module", params=runnable_levels("decode_layer"))
def kernel(request) -> decode_layer.DecodeLayerKernel:
    return load_at_level(decode_layer._load, request.param, "the fused decode layer")


def decode_batch(lens: list[int], vocab: int, seed: int) -> ForwardBatch:
    """One decode row per sequence at position len - 1, pages drawn at random from the pool."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(PAGES, generator=g).tolist()
    width = max(-(-n // PAGE) for n in lens)
    tables, slots = [], []
    for n in lens:
        pages, perm = perm[:-(-n // PAGE)], perm[-(-n // PAGE):]
        slots.append(pages[(n - 1) // PAGE] * PAGE + (n - 1) % PAGE)
        tables.append(pages + [0] * (width - len(pages)))
    rows = len(lens)
    return ForwardBatch(
        input_ids=torch.randint(3, vocab, (rows,), generator=g), positions=torch.tensor([n - 1 for n in lens]),
        slot_mapping=torch.tensor(slots), cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=torch.tensor(tables, dtype=torch.int32),
        logits_indices=torch.arange(rows), num_decodes=rows, max_seqlen_q=1, max_seqlen_k=max(lens),
        query_lens_cpu=[1] * rows, seq_lens_cpu=list(lens))


def filled_cache(loaded: Loaded, seed: int, dtype: torch.dtype = torch.float32) -> KVCache:
    cache = KVCache(loaded.config, PAGES, PAGE, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    for k, v in cache.layers:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    return cache


def cpu_backend(dtype: torch.dtype = torch.float32):
    try:
        return select_backend("cpu", "cpu", dtype=dtype)
    except RuntimeError as exc:
        pytest.skip(f"the cpu backend does not run here: {exc}")


@pytest.fixture(scope="module")
def bf16_models(tiny_dirs) -> dict:
    """name -> our model in bfloat16 (the fused layer binds it as it binds float32)."""
    return {name: load_model(tiny_dirs[name], torch.bfloat16, "cpu")[0] for name in ARCH_PRESETS}


def fused_and_modules(model, batch, backend, fused_cache, module_cache, threads):
    """The step's logits through the fused layers, then module by module (each on its own cache)."""
    with torch_threads(threads):
        meta = backend.prepare(batch)
        x = model.embed_tokens(batch.input_ids)
        assert model._decode_step(batch, x, *model.rope.lookup(batch.positions), fused_cache.layers,
                                  backend, meta) is not None, "this step takes the fused path"
        fused = model(batch, fused_cache.layers, backend, meta)
        kept = model.decode_kernel, model.decode_whole, model.decode_ints
        model.use_decode_kernel(None)
        try:
            reference = model(batch, module_cache.layers, backend, backend.prepare(batch))
        finally:
            model.decode_kernel, model.decode_whole, model.decode_ints = kept
    return fused, reference


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("lens", [[37], [5, 61, 18], [9, 1, 30, 47]])
def test_fused_layers_equal_the_layers_module_by_module(kernel, loaded: Loaded, threads, lens) -> None:
    model, backend = loaded.model, cpu_backend()
    assert model.decode_whole is not None, "the loader binds the fused decode step on CPU"
    batch = decode_batch(lens, loaded.config.vocab_size, seed=len(lens))
    fused_cache, module_cache = filled_cache(loaded, 1), filled_cache(loaded, 1)
    fused, reference = fused_and_modules(model, batch, backend, fused_cache, module_cache, threads)
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)   # test_equivalence.py's TOL
    for (k1, v1), (k2, v2) in zip(fused_cache.layers, module_cache.layers):   # the new K/V slots too
        torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens", [[37], [5, 61, 18, 40]])
def test_bfloat16_fused_layers_round_as_the_modules_do(kernel, loaded: Loaded, bf16_models, threads, lens) -> None:
    """Every product and sum rounded to bfloat16 where the module path rounds it: the same
    logits but for the odd last-bit difference (exp and the q/k norm's sum order), far inside
    what bfloat16 itself moves them (a random bf16 step moves these logits by ~1e-1)."""
    model, backend = bf16_models[loaded.path.name], cpu_backend(torch.bfloat16)
    batch = decode_batch(lens, loaded.config.vocab_size, seed=7 + len(lens))
    fused_cache = filled_cache(loaded, 3, torch.bfloat16)
    module_cache = filled_cache(loaded, 3, torch.bfloat16)
    fused, reference = fused_and_modules(model, batch, backend, fused_cache, module_cache, threads)
    assert fused.dtype == torch.float32
    diff = (fused - reference).abs()
    assert diff.max() <= 0.05 * reference.abs().max(), float(diff.max())
    assert (diff == 0).float().mean() > 0.9, "nearly every logit bit-identical"
    for (k1, v1), (k2, v2) in zip(fused_cache.layers, module_cache.layers):
        assert (k1 != k2).sum() <= 0.01 * k1.numel() and (v1 != v2).sum() <= 0.01 * v1.numel()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens", [[37], [5, 61, 18, 40]])
def test_float32_fused_layers_over_bfloat16_pages(kernel, loaded: Loaded, threads, lens) -> None:
    """A float32 model with --kv-cache-dtype bfloat16: the fused layer rounds each new K/V value
    once as it writes it and widens the pages as it reads them, as the module path does
    (index_copy_ of the rounded rows, the paged kernel's bfloat16 pages)."""
    model, backend = loaded.model, cpu_backend()
    batch = decode_batch(lens, loaded.config.vocab_size, seed=13 + len(lens))
    fused_cache = filled_cache(loaded, 4, torch.bfloat16)
    module_cache = filled_cache(loaded, 4, torch.bfloat16)
    fused, reference = fused_and_modules(model, batch, backend, fused_cache, module_cache, threads)
    torch.testing.assert_close(fused, reference, rtol=1e-3, atol=1e-3)
    for (k1, v1), (k2, v2) in zip(fused_cache.layers, module_cache.layers):
        assert k1.dtype == torch.bfloat16
        # the new rows are the same float32 values rounded the same way, but for a last-bit
        # difference where the C and the module path contract a product differently
        assert (k1 != k2).sum() <= 0.01 * k1.numel() and (v1 != v2).sum() <= 0.01 * v1.numel()
    before = filled_cache(loaded, 4, torch.bfloat16).layers[0][0].flatten(0, 1)[batch.slot_mapping]
    assert not torch.equal(fused_cache.layers[0][0].flatten(0, 1)[batch.slot_mapping], before), "K rows written"


def test_steps_it_does_not_take_run_module_by_module(kernel, load_pair) -> None:
    loaded = load_pair("tiny")
    model, cache = loaded.model, filled_cache(loaded, 2)
    geometry = model.decode_geometry
    most = decode_layer.MAX_ROWS
    batch = decode_batch([3] * (most + 1), loaded.config.vocab_size, seed=3)   # one row too many
    x = model.embed_tokens(batch.input_ids)
    cos, sin = model.rope.lookup(batch.positions)
    args = (batch.slot_mapping, batch.block_tables, batch.seq_lens, cache.layers[0][0])
    assert kernel.step(geometry, x, cos, sin, *args) is None
    fewer = [a[:most] for a in (cos, sin, *args[:3])]
    assert kernel.step(geometry, x[:most].bfloat16(), *fewer, args[3]) is None
    assert kernel.step(geometry, x[:most], *fewer, args[3]) is not None
    # the torch backend gathers pages itself: no fused step, the same logits as ever
    assert model._decode_step(batch, x, cos, sin, cache.layers, torch_attention(),
                              torch_attention().prepare(batch)) is None


def test_indices_outside_the_cache_are_refused_not_written(kernel, load_pair) -> None:
    loaded = load_pair("tiny")
    model, cache = loaded.model, filled_cache(loaded, 4)
    batch = decode_batch([6, 10], loaded.config.vocab_size, seed=5)
    x = model.embed_tokens(batch.input_ids)
    cos, sin = model.rope.lookup(batch.positions)
    for slots, tables in ((torch.tensor([0, PAGES * PAGE]), batch.block_tables),
                          (torch.tensor([-1, 0]), batch.block_tables),
                          (batch.slot_mapping, batch.block_tables.clone().fill_(PAGES))):
        with pytest.raises(ValueError, match="outside the KV cache"):
            kernel.step(model.decode_geometry, x, cos, sin, slots, tables, batch.seq_lens, cache.layers[0][0])


def test_bind_checks_every_weight(kernel, load_pair) -> None:
    model = load_pair("tiny-qwen3").model
    weights = model.layers[0].decode_weights()
    geometry = model.decode_geometry
    with pytest.raises(ValueError, match="qkv must be a contiguous torch.float32 CPU tensor"):
        kernel.bind(geometry, {**weights, "qkv": weights["qkv"].t()})
    with pytest.raises(ValueError, match="down is required"):
        kernel.bind(geometry, {**weights, "down": None})
    with pytest.raises(ValueError, match="q_norm and k_norm come together"):
        kernel.bind(geometry, {**weights, "k_norm": None})
    with pytest.raises(ValueError, match="float32"):
        kernel.bind(geometry, {**weights, "o": weights["o"].double()})


def direct_args(batch: ForwardBatch) -> tuple:
    """The step's plain ints, as ModelRunner hands them to DirectStep: each row's table cut to its length."""
    lens = batch.seq_lens_cpu
    tables = [row[:-(-n // PAGE)] for row, n in zip(batch.block_tables.tolist(), lens)]
    return (batch.input_ids.tolist(), batch.positions.tolist(), batch.slot_mapping.tolist(), tables, list(lens))


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("lens", [[37], [5, 61, 18], [9, 1, 30, 47]])
def test_the_direct_step_is_the_tensor_step_bit_for_bit(kernel, loaded: Loaded, bf16_models, dtype, cache_dtype,
                                                        lens) -> None:
    """The same native call from plain ints (the embedding rows and RoPE angles copied, the
    indices in ctypes arrays): the same logits and K/V, to the bit."""
    model = loaded.model if dtype == torch.float32 else bf16_models[loaded.path.name]
    backend = cpu_backend(dtype)
    assert model.decode_ints is not None and backend.decodes_natively()
    batch = decode_batch(lens, loaded.config.vocab_size, seed=11 + len(lens))
    tensor_cache, direct_cache = filled_cache(loaded, 5, cache_dtype), filled_cache(loaded, 5, cache_dtype)
    expected = model(batch, tensor_cache.layers, backend, backend.prepare(batch))
    got = model.decode_ints(*direct_args(batch), direct_cache.layers)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    for (k1, v1), (k2, v2) in zip(tensor_cache.layers, direct_cache.layers):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_the_direct_step_refuses_bad_indices_and_passes_on_steps_it_does_not_take(kernel, load_pair) -> None:
    loaded = load_pair("tiny")
    model, cache = loaded.model, filled_cache(loaded, 6)
    direct = model.decode_ints
    ids, positions, slots, tables, lens = direct_args(decode_batch([6, 10], loaded.config.vocab_size, seed=5))
    before = [(k.clone(), v.clone()) for k, v in cache.layers]
    for bad_ids, bad_slots, bad_tables, match in (
            ([ids[0], loaded.config.vocab_size], slots, tables, "outside the vocabulary"),
            ([-1, ids[1]], slots, tables, "outside the vocabulary"),
            (ids, [slots[0], PAGES * PAGE], tables, "outside the KV cache"),
            (ids, [-1, slots[1]], tables, "outside the KV cache"),
            (ids, slots, [tables[0], [PAGES] * len(tables[1])], "outside the KV cache"),
            # a row without its slot: the missing one was 0, and its K/V overwrote another's slot 0
            (ids, slots[:1], tables, "a row without its position, slot, table or length")):
        with pytest.raises(ValueError, match=match):
            direct(bad_ids, positions, bad_slots, bad_tables, lens, cache.layers)
    with pytest.raises(ValueError, match="a negative position"):   # read before the RoPE table
        direct(ids, [-3, positions[1]], slots, tables, lens, cache.layers)
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(cache.layers, before))
    many = decode_layer.MAX_ROWS + 1   # the tensor path's (the packed GEMMs) from here
    assert direct([ids[0]] * many, [positions[0]] * many, [slots[0]] * many, [tables[0]] * many,
                  [lens[0]] * many, cache.layers) is None
    past = model.rope.cos.shape[0]   # past the RoPE table: the tensor path grows it
    assert direct(ids[:1], [past], slots[:1], tables[:1], [past + 1], cache.layers) is None
    # a row's length past its own table (not the widest's): it read the padding's page 0
    assert direct(ids, positions, slots, [tables[1], tables[0][:1]], [lens[1], lens[1]], cache.layers) is None
    assert direct(ids, positions, slots, tables, lens, cache.layers) is not None


def test_a_geometry_the_fused_step_does_not_take_runs_layer_by_layer(kernel, caplog) -> None:
    """bind's refusal escaped use_decode_kernel: such a model failed to load, where the attention
    backend would have served it."""
    from kvserve.model_service.kernels import small_linear
    from kvserve.model_service.model.config import ModelConfig
    from kvserve.model_service.model.llama import CausalLM

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=16, hidden_size=64, num_layers=1,
                         num_heads=130, num_kv_heads=2, head_dim=128, intermediate_size=32, rms_norm_eps=1e-6,
                         rope_theta=1e4, rope_scaling=None, qkv_bias=False, o_bias=False, mlp_bias=False,
                         qk_norm=False, tie_word_embeddings=False, max_position_embeddings=64, sliding_window=None,
                         max_model_len=64, bos_token_id=None, eos_token_ids=())   # heads x head_dim past its range
    model = CausalLM(config).eval()
    model.use_small(small_linear.load())
    caplog.set_level("INFO")
    model.use_decode_kernel(kernel)
    assert model.decode_whole is None and model.decode_ints is None and "layer by layer" in caplog.text
