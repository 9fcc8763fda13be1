import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_service.sampling import sampler as sampler_module
from kvserve.model_service.sampling.params import SamplingParams
from kvserve.model_service.sampling.sampler import (
    Sampler,
    exponential_noise,
    make_generator,
    min_p_mask,
    row_argmax,
    seeded_for,
    top_k_top_p_mask,
)

V = 1000


def _logits(seed: int, rows: int, vocab: int = V, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_fast_path_is_argmax(dtype):
    logits = _logits(0, 16).to(dtype)
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 16)
    assert out.token_ids == torch.argmax(logits, dim=-1).tolist()
    assert out.logprobs == [None] * 16


SPECIAL = st.sampled_from([0.0, -0.0, 1.0, -1.0, 3.5, float("inf"), float("-inf"), float("nan")])


@st.composite
def logit_rows(draw):
    width = draw(st.integers(1, 40))
    value = st.one_of(SPECIAL, st.floats(-1e3, 1e3, width=32))
    return draw(st.lists(st.lists(value, min_size=width, max_size=width), min_size=1, max_size=6))


@settings(max_examples=200, deadline=None)
@given(logit_rows())
def test_row_argmax_is_torch_argmax_ties_infinities_and_nan_included(rows):
    x = torch.tensor(rows, dtype=torch.float32)
    got = row_argmax(x)
    assert got.dtype == torch.int64
    assert got.tolist() == torch.argmax(x, dim=-1).tolist()


@pytest.mark.parametrize("native", [True, False], ids=["native kernel", "numpy"])
def test_row_argmax_takes_views_other_dtypes_and_tensors_that_need_grad(monkeypatch, native):
    if not native:   # where the kernel does not build: numpy's argmax for every CPU float32 tensor
        monkeypatch.setattr(sampler_module, "_native_argmax", lambda: None)
    x = _logits(5, 8)
    assert row_argmax(x).tolist() == torch.argmax(x, dim=-1).tolist()
    assert row_argmax(x[::2, 1::3]).tolist() == torch.argmax(x[::2, 1::3], dim=-1).tolist()   # not contiguous
    assert row_argmax(x.t()).tolist() == torch.argmax(x.t(), dim=-1).tolist()
    assert row_argmax(x.to(torch.bfloat16)).tolist() == torch.argmax(x.to(torch.bfloat16), dim=-1).tolist()
    assert row_argmax(x.clone().requires_grad_()).tolist() == torch.argmax(x, dim=-1).tolist()
    with torch.inference_mode():
        y = _logits(6, 3)
        assert row_argmax(y).tolist() == torch.argmax(y, dim=-1).tolist()


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = _logits(1, 8).to(torch.bfloat16)
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, top_p=0.8) for i in range(8)]
    out = Sampler()(logits, params)
    expected = torch.argmax(logits, dim=-1).tolist()
    assert [t for i, t in enumerate(out.token_ids) if i % 2] == expected[1::2]


def test_greedy_ties_go_to_the_first_id_like_argmax():
    logits = torch.zeros(2, 10)
    logits[:, [3, 7]] = 5.0
    greedy = [SamplingParams(temperature=0), SamplingParams(temperature=0, presence_penalty=0.1)]
    assert Sampler()(logits, greedy, [[]] * 2, [[]] * 2).token_ids == [3, 3]


@settings(max_examples=60, deadline=None)
@given(ks=st.lists(st.integers(1, 2000), min_size=1, max_size=6), seed=st.integers(0, 1000),
       ties=st.booleans())
def test_each_rows_kth_largest_is_the_sorted_rows_whatever_the_others_k(ks, seed, ties):
    """Rows are ranked in groups of like k (one row's k of 150,000 made every row rank that
    many); past half the vocabulary from below. Ties included: values decide, not order."""
    vocab = 2000
    logits = _logits(seed, len(ks), vocab)
    if ties:
        logits = logits.round()
    top_k = torch.tensor(ks)
    k_on = top_k < vocab
    kth = sampler_module._kth_largest(logits, top_k, k_on)
    for i, k in enumerate(ks):
        expected = logits[i].sort(descending=True).values[k - 1] if k < vocab else float("-inf")
        assert kth[i, 0] == expected
        alone = sampler_module._kth_largest(logits[i:i + 1], top_k[i:i + 1], k_on[i:i + 1])
        assert alone[0, 0] == kth[i, 0]


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([[1.0, 5.0, 3.0, 5.0, 3.0, 3.0]])
    mask = top_k_top_p_mask(logits, logits, torch.tensor([1]), torch.tensor([1.0]))
    assert _kept(mask) == [{1, 3}]
    mask = top_k_top_p_mask(logits, logits, torch.tensor([3]), torch.tensor([1.0]))
    assert _kept(mask) == [{1, 2, 3, 4, 5}]


@pytest.mark.parametrize("temperature", [0.05, 0.5, 1.0, 2.0, 10.0, 100.0])
def test_top_k_1_equals_greedy_for_any_temperature(temperature):
    logits = _logits(2, 16)
    params = [SamplingParams(temperature=temperature, top_k=1, seed=i) for i in range(16)]
    gens = [make_generator(i) if i % 2 else None for i in range(16)]
    for _ in range(3):
        out = Sampler()(logits, params, generators=gens)
        assert out.token_ids == torch.argmax(logits, dim=-1).tolist()


# ---------------------------------------------------------------- seeds


def _run_steps(logit_steps, params, generators, row):
    """Sample every step; return the tokens of `row`."""
    tokens = []
    outputs = [[] for _ in params]
    for logits in logit_steps:
        out = Sampler()(logits, params, [[1, 2, 3]] * len(params), outputs, generators)
        for i, t in enumerate(out.token_ids):
            outputs[i].append(t)
        tokens.append(out.token_ids[row])
    return tokens


# A large vocabulary too: torch may split a reduction over one long row across threads, which a
# seeded row alone would hit and the same row in a batch would not.
@pytest.mark.parametrize(
    ("vocab", "top_k"), [(V, 200), (V, 0), pytest.param(152064, 0, marks=pytest.mark.slow)]
)
def test_same_seed_same_tokens_whatever_else_is_in_the_batch(vocab, top_k):
    target = SamplingParams(temperature=0.9, top_k=top_k, top_p=0.95, min_p=0.01,
                            repetition_penalty=1.1, frequency_penalty=0.2, seed=1234)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5, seed=7),
        SamplingParams(temperature=0.7, top_p=0.5),
        SamplingParams(top_k=5, seed=99, presence_penalty=1.0),
        SamplingParams(min_p=0.2),
        SamplingParams(temperature=0, repetition_penalty=1.3),
        SamplingParams(temperature=2.0, top_k=50, top_p=0.9, seed=1234 + 1),
    ]
    steps = 6 if vocab < 10_000 else 3
    # The target row's logits are the same in both runs; the batch around it differs.
    target_logits = [_logits(100 + s, 1, vocab, scale=3.0) for s in range(steps)]
    alone = _run_steps(target_logits, [target], [make_generator(1234)], row=0)

    batch = others[:3] + [target] + others[3:]
    batch_logits = [
        torch.cat([_logits(200 + s, 3, vocab), target_logits[s], _logits(300 + s, 4, vocab)])
        for s in range(steps)
    ]
    gens = [None if p.seed is None else make_generator(p.seed) for p in batch]
    torch.manual_seed(0)  # unseeded rows draw from the global stream; it must not matter
    together = _run_steps(batch_logits, batch, gens, row=3)
    assert together == alone

    # Order in the batch does not matter either.
    batch2 = [target] + others
    logits2 = [torch.cat([target_logits[s], _logits(400 + s, 7, vocab)]) for s in range(steps)]
    gens2 = [None if p.seed is None else make_generator(p.seed) for p in batch2]
    assert _run_steps(logits2, batch2, gens2, row=0) == alone

    # A different seed gives different tokens (the test would be vacuous otherwise).
    other_seed = _run_steps(target_logits, [target], [make_generator(4321)], row=0)
    assert other_seed != alone


def test_a_seeded_rows_noise_comes_from_its_generator_alone():
    gens = [make_generator(3), None, make_generator(4), None]
    noise = exponential_noise(torch.Size((4, 100)), gens, torch.device("cpu"))
    alone = exponential_noise(torch.Size((1, 100)), [make_generator(4)], torch.device("cpu"))
    assert torch.equal(noise[2], alone[0])
    assert bool((noise > 0).all() and (noise < 64).all())


def test_a_uniform_draw_of_0_lets_no_unlikely_token_win():
    """A float32 uniform is 0 once in 2^24 cells; its noise was clamped to float32's tiniest,
    so a token of probability e^-40 won there: a wrong tail token about once in 110 draws on a
    150k vocabulary."""
    vocab = 1 << 20

    def uniform(seed):
        return torch.empty(vocab).uniform_(generator=make_generator(seed))
    seed = next(s for s in range(1000) if bool((uniform(s) == 0).any()))
    zero = int((uniform(seed) == 0).nonzero()[0])
    likely = (zero + 1) % vocab
    logits = torch.full((1, vocab), -40.0)
    logits[0, likely] = 0.0
    out = Sampler()(logits, [SamplingParams(temperature=1.0, seed=seed)], generators=[make_generator(seed)])
    assert out.token_ids == [likely]
    noise = exponential_noise(torch.Size((1, vocab)), [make_generator(seed)], torch.device("cpu"))
    assert noise[0, zero] == 2.0 ** -25 == noise.min()


def test_a_uniform_of_0_is_the_smallest_noise_on_a_cpu_and_the_largest_on_cuda():
    """CUDA's uniform_ maps curand's (0, 1] to [0, 1) by turning 1 into 0: there, 0 is the top of
    the range, and its noise must be the largest (no token should win with it), where the
    CPU's 0 stands for the bottom."""
    from kvserve.model_service.sampling.sampler import exponential_from_uniform
    u = torch.tensor([0.0, 0.5, 1 - 2 ** -24])
    cpu = exponential_from_uniform(u.clone(), zero_is_top=False)
    cuda = exponential_from_uniform(u.clone(), zero_is_top=True)
    assert cpu[0] == 2.0 ** -25 and cuda[0] == 64.0
    assert torch.equal(cpu[1:], cuda[1:]) and cpu[1] == pytest.approx(math.log(2))


def test_a_seeded_draw_depends_on_seed_and_position_alone():
    """What lets a recomputed or migrated request go on with the tokens it would have drawn:
    the draw for position p is the same whatever the generator drew before."""
    shape, cpu = torch.Size((1, 100)), torch.device("cpu")

    def draw(gen):
        return exponential_noise(shape, [gen], cpu)

    fresh = draw(seeded_for(make_generator(9), 9, 5))
    used = make_generator(9)
    for _ in range(7):
        draw(used)
    assert torch.equal(draw(seeded_for(used, 9, 5)), fresh)
    assert not torch.equal(draw(seeded_for(used, 9, 6)), fresh)    # another position
    assert not torch.equal(draw(seeded_for(used, 10, 5)), fresh)   # another seed
    assert not torch.equal(draw(seeded_for(used, 9 + 1, 5 - 1)), draw(seeded_for(used, 9, 5)))


# ---------------------------------------------------------------- distributions


def _chi_square(tokens: list[int], probs: list[float]) -> float:
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).tolist()
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_reshapes_the_distribution(temperature):
    base = [0.1, 0.2, 0.3, 0.4]
    logits = torch.tensor(base).log().repeat(20000, 1)              # (N, 4) one draw per row
    expected = [p ** (1 / temperature) for p in base]
    expected = [p / sum(expected) for p in expected]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tokens = Sampler()(logits, [SamplingParams(temperature=temperature)] * 20000).token_ids
    # 3 degrees of freedom: P(chi2 > 16.3) = 0.001; loose on purpose.
    assert _chi_square(tokens, expected) < 25
    # A seeded row over many steps follows the same law.
    gen = make_generator(5)
    params = [SamplingParams(temperature=temperature, seed=5)]
    seeded = [Sampler()(logits[:1], params, generators=[gen]).token_ids[0] for _ in range(2000)]
    assert _chi_square(seeded, expected) < 25


# ---------------------------------------------------------------- masks

# Probabilities 0.5, 0.25, 0.15, 0.1 laid out out of order, so ranks differ from ids.
PROBS = [0.15, 0.5, 0.1, 0.25]


def _kept(mask: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(~row).flatten().tolist()) for row in mask]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "kept"),
    [
        (1.0, 4, 1.0, {0, 1, 2, 3}),   # both off
        (1.0, 2, 1.0, {1, 3}),
        (1.0, 1, 1.0, {1}),
        (1.0, 4, 0.4, {1}),            # 0.5 alone reaches 0.4
        (1.0, 4, 0.6, {1, 3}),         # 0.5 < 0.6 → keep 0.25; 0.75 ≥ 0.6 → drop the rest
        (1.0, 4, 0.8, {0, 1, 3}),      # 0.75 < 0.8 → keep 0.15; 0.9 ≥ 0.8 → drop 0.1
        (1.0, 3, 0.8, {1, 3}),         # top-3 renormalised: .556, .278, .167; .833 ≥ .8
        (2.0, 4, 0.6, {1, 3}),         # T=2: ∝ sqrt(p) = .370 .262 .203 .166; .632 ≥ .6
        (2.0, 4, 0.7, {0, 1, 3}),      # .632 < .7 keeps the third at T=2 (not at T=1)
    ],
)
def test_top_k_top_p_mask_keeps_exactly(temperature, top_k, top_p, kept):
    logits = torch.tensor([PROBS]).log() + 3.0  # a shift must not matter
    mask = top_k_top_p_mask(logits, logits / temperature, torch.tensor([top_k]),
                            torch.tensor([top_p]))
    assert _kept(mask) == [kept]


@pytest.mark.parametrize(
    ("min_p", "kept"),
    [(0.0, {0, 1, 2, 3}), (0.19, {0, 1, 2, 3}), (0.25, {0, 1, 3}), (0.4, {1, 3}), (1.0, {1})],
)
def test_min_p_mask_keeps_exactly(min_p, kept):
    # p / p_max = 0.3, 1, 0.2, 0.5
    logits = torch.tensor([PROBS]).log() - 1.0
    assert _kept(min_p_mask(logits, torch.tensor([min_p]))) == [kept]


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(top_p=0.6), {1, 3}),
        (SamplingParams(top_k=3, top_p=0.8), {1, 3}),
        (SamplingParams(min_p=0.25), {0, 1, 3}),
        (SamplingParams(top_p=0.8, min_p=0.4), {1, 3}),
        (SamplingParams(temperature=2.0, top_p=0.7), {0, 1, 3}),
    ],
)
def test_sampled_tokens_cover_exactly_the_kept_set(params, kept):
    n = 4000
    logits = torch.tensor([PROBS]).log().repeat(n, 1)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        tokens = Sampler()(logits, [params] * n).token_ids
    assert set(tokens) == kept


def test_mask_rows_are_independent():
    logits = torch.tensor([PROBS] * 3).log()
    mask = top_k_top_p_mask(logits, logits, torch.tensor([4, 1, 4]),
                            torch.tensor([1.0, 1.0, 0.6]))
    assert _kept(mask) == [{0, 1, 2, 3}, {1}, {1, 3}]


def test_top_p_ties_at_the_cutoff_are_all_kept():
    logits = torch.tensor([[0.5, 0.25, 0.25]]).log()
    mask = top_k_top_p_mask(logits, logits, torch.tensor([3]), torch.tensor([0.6]))
    assert _kept(mask) == [{0, 1, 2}]


@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0])
def test_top_p_candidate_sets_do_not_change_the_mask(monkeypatch, scale):
    # Flat rows need thousands of tokens (retries up to a full sort), peaked ones a few; bf16
    # rounding makes ties common. Tiny candidate sets must give the full sort's answer exactly.
    logits = (_logits(5, 12, vocab=5000, scale=scale)).to(torch.bfloat16).float()
    scaled = logits / torch.tensor([0.5, 1.0, 1.7] * 4).unsqueeze(1)
    top_k = torch.tensor([5000, 5000, 5000, 40, 4000, 5000] * 2)
    top_p = torch.tensor([0.3, 0.9, 0.99, 0.9, 0.95, 1.0, 0.5, 0.999, 0.1, 0.6, 0.7, 0.8])
    monkeypatch.setattr(sampler_module, "_TOP_P_CANDIDATES", ())
    full_sort = top_k_top_p_mask(logits, scaled, top_k, top_p)
    for sizes in [(1,), (2, 8), (16, 300, 3000), (256, 4096)]:
        monkeypatch.setattr(sampler_module, "_TOP_P_CANDIDATES", sizes)
        assert torch.equal(top_k_top_p_mask(logits, scaled, top_k, top_p), full_sort)
    kept = (~full_sort).sum(dim=-1)
    assert kept[5] == 5000 and kept[3] <= 40 and (kept > 0).all()


# ---------------------------------------------------------------- penalties

RAW = [2.0, -1.0, 0.5, -3.0, 1.5]
PROMPT = [0]
OUTPUT = [1, 1, 2]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # HF repetition over prompt + output: >0 divides, <=0 multiplies.
        (SamplingParams(repetition_penalty=2.0), [1.0, -2.0, 0.25, -3.0, 1.5]),
        # presence over output only: tokens 1 and 2 (not prompt token 0).
        (SamplingParams(presence_penalty=0.5), [2.0, -1.5, 0.0, -3.0, 1.5]),
        # frequency × count: token 1 twice, token 2 once.
        (SamplingParams(frequency_penalty=0.25), [2.0, -1.5, 0.25, -3.0, 1.5]),
        # all three: repetition first, then presence and frequency.
        (SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
         [1.0, -3.0, -0.5, -3.0, 1.5]),
        # negative presence/frequency reward repeats.
        (SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5), [2.0, 1.0, 2.0, -3.0, 1.5]),
    ],
)
def test_penalties_give_exact_logits(params, expected):
    logits = torch.tensor([RAW])
    greedy = dataclasses.replace(params, temperature=0, logprobs=5)
    out = Sampler()(logits, [greedy], [PROMPT], [OUTPUT])
    expected_lp = torch.log_softmax(torch.tensor(expected), dim=-1)
    lp = out.logprobs[0]
    assert out.token_ids == [int(torch.tensor(expected).argmax())]
    assert dict(lp.top) == pytest.approx(dict(enumerate(expected_lp.tolist())), abs=1e-6)
    assert logits.tolist() == [RAW]  # the caller's logits are left alone


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([RAW])
    plain = Sampler()(logits, [SamplingParams(temperature=0)])
    penalised = Sampler()(logits, [SamplingParams(temperature=0, repetition_penalty=2.0)],
                          [PROMPT], [OUTPUT])
    assert plain.token_ids == [0] and penalised.token_ids == [4]


def test_logit_bias_moves_the_choice_and_the_logprobs_only_in_its_row():
    logits = _logits(11, 3)
    best = row_argmax(logits).tolist()
    forced, banned = (best[0] + 1) % V, best[1]
    params = [SamplingParams(temperature=0, logit_bias=((forced, 100.0),), logprobs=0),
              SamplingParams(temperature=0, logit_bias=((banned, -100.0),)),
              SamplingParams(temperature=0)]
    out = Sampler()(logits.clone(), params, [[]] * 3, [[]] * 3)
    second = torch.topk(logits[1], 2).indices.tolist()[1]
    assert out.token_ids == [forced, second, best[2]]
    biased = logits[0].clone()
    biased[forced] += 100
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(biased, -1)[forced].item(), abs=1e-5)
    # sampled rows see the bias too: +100 is all but certain
    hot = Sampler()(logits.clone(), [SamplingParams(temperature=1.0, logit_bias=((7, 100.0),))] * 3, [[]] * 3,
                    [[]] * 3, [make_generator(s) for s in (1, 2, 3)])
    assert hot.token_ids == [7, 7, 7]


def test_min_tokens_holds_eos_and_stop_token_ids_back_until_reached():
    logits = torch.full((1, 10), -5.0)
    logits[0, 2], logits[0, 3], logits[0, 4] = 9.0, 8.0, 7.0    # EOS, then a stop token id, then a word
    sampler = Sampler(eos_token_ids=[2])
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(3,))
    assert [sampler(logits.clone(), [p], [[]], [[5] * n]).token_ids[0] for n in (0, 2, 3)] == [4, 4, 2]
    ignoring = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(3,), ignore_eos=True)
    assert sampler(logits.clone(), [ignoring], [[]], [[]]).token_ids == [2]   # EOS is no stop here
    assert Sampler()(logits.clone(), [p], [[]], [[]]).token_ids == [2]        # no EOS known: 2 is a word
    only_ends = torch.full((1, 10), float("-inf"))                             # all a format still allows:
    only_ends[0, 2], only_ends[0, 3] = 1.0, 2.0                                # EOS and the stop token id
    assert sampler(only_ends, [p], [[]], [[]]).token_ids == [3]                # the request may end


def test_penalised_rows_need_histories():
    with pytest.raises(ValueError, match="prompt_ids and output_ids"):
        Sampler()(torch.zeros(1, 5), [SamplingParams(presence_penalty=1.0)])


# ---------------------------------------------------------------- logprobs


def test_logprobs_shapes_and_values():
    logits = _logits(3, 4).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0.3, logprobs=0, seed=1),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=10, logprobs=20),
    ]
    gens = [None, make_generator(1), None, None]
    out = Sampler()(logits, params, generators=gens)
    reference = torch.log_softmax(logits.float(), dim=-1)  # before temperature, any dtype in

    assert out.logprobs[2] is None
    for row, n in [(0, 5), (1, 0), (3, 20)]:
        lp = out.logprobs[row]
        token = out.token_ids[row]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(reference[row, token].item(), abs=1e-5)
        assert len(lp.top) == n
        values, ids = reference[row].topk(n) if n else (torch.empty(0), torch.empty(0))
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-5)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        for token_id, value in lp.top:
            assert value == pytest.approx(reference[row, token_id].item(), abs=1e-5)
    assert out.logprobs[0].top[0][0] == out.token_ids[0]  # greedy picks the most likely


def test_logprobs_on_the_greedy_fast_path():
    logits = _logits(4, 2)
    out = Sampler()(logits, [SamplingParams(temperature=0, logprobs=3)] * 2)
    reference = torch.log_softmax(logits, dim=-1)
    for row in range(2):
        assert out.logprobs[row].logprob == pytest.approx(reference[row].max().item(), abs=1e-6)
        assert math.isclose(sum(math.exp(v) for _, v in out.logprobs[row].top),
                            reference[row].topk(3).values.exp().sum().item(), rel_tol=1e-5)


def test_logprobs_asked_for_more_than_the_vocabulary():
    out = Sampler()(torch.zeros(1, 3), [SamplingParams(logprobs=20)])
    assert len(out.logprobs[0].top) == 3


def test_rejects_a_params_count_mismatch():
    with pytest.raises(ValueError, match="2 SamplingParams for 3 rows"):
        Sampler()(torch.zeros(3, 5), [SamplingParams()] * 2)
