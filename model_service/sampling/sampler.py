"""Samples one token per row for a batch of logits, vectorised over the batch.

Per row, in this order (vLLM v1's, but with min-p after top-k/top-p):

    logits (S, V) ──upcast to float32──► penalties ──┬─ greedy rows ──► argmax
                                                     └─ other rows ──► / temperature ──► top-k
                                                         ──► top-p ──► min-p ──► softmax
                                                         ──► argmax(probs / Exp(1) noise)

Greedy. A row with temperature 0 takes the argmax of its penalised logits; with no penalties
that is exactly `torch.argmax` of the raw logits (upcasting is exact, ties go to the first id).
A batch that is all greedy with no penalties takes a fast path that is just that argmax. On CPU
every argmax here is row_argmax's: the same choice, ties and NaN included, in a fraction of
torch's reduction's time (docs/benchmarks.md).

Sampling. `argmax(probs / q)` with q ~ Exp(1) i.i.d. draws a token with probability `probs`
(the exponential race; equivalent to Gumbel-max). A row with a generator draws its V
exponentials from it and from nothing else, and every other op is row-wise, so a seeded row's
tokens depend only on its own logits, parameters and seed: same seed, same tokens, whatever else
is in the batch. Rows without a generator share one draw from torch's default generator. The
engine seeds a row's generator for the token's position first (seeded_for), so the draw does not
depend on the request's history of steps either.

Shaping, before penalties: a row with a structured output's matcher keeps only the tokens its
format allows next (structured.py); a row's logit_bias is added to its logits; while it has fewer
output tokens than its min_tokens, EOS (unless ignore_eos) and its stop_token_ids are masked out,
unless they are all its format allows.

Logprobs. `log_softmax` of the logits after shaping and penalties and before temperature,
top-k, top-p and min-p: the model's distribution as they shaped it, independent of how the token
was then picked. (vLLM v1's default `raw_logprobs` is taken before penalties too; the two agree whenever
no penalty is set.) Returned for the chosen token plus the top n, most likely first.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.model_service.kernels import row_argmax as row_argmax_kernel
from kvserve.model_service.sampling.params import SamplingParams
from kvserve.model_service.sampling.penalties import TokenIds, apply_penalties
from kvserve.model_service.sampling.structured import mask_rows


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """(R, V) -> (R,) int64: each row's index of its largest value, the first where tied, a NaN
    counting as the largest: torch.argmax's answer. CPU float32 rows go to the native kernel
    (kernels/row_argmax.c: each thread scans the logits it wrote) or, without it or for a view,
    to numpy's argmax; either is far faster there than torch's reduction (docs/benchmarks.md)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and not x.requires_grad:
        native = _native_argmax()
        if native is not None and native.runs(x):
            return native(x)
        return torch.from_numpy(x.numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return x.argmax(dim=-1)


@functools.cache   # load() is once per process too, but re-raises where it cannot: not per step
def _native_argmax():
    try:
        return row_argmax_kernel.load()
    except row_argmax_kernel.KernelUnavailable:
        return None


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first; empty for logprobs=0


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]                   # one per row
    logprobs: list[TokenLogprobs | None]   # one per row; None where the row asked for none


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator for a seeded request; it lives as long as the request, and
    seeded_for() sets it for each token it draws."""
    return torch.Generator(device=device).manual_seed(seed)


_MASK64 = (1 << 64) - 1


def seeded_for(generator: torch.Generator, seed: int, position: int) -> torch.Generator:
    """`generator`, seeded for the request's output token `position` (0 for the first).

    A seeded request's draw for a token is a function of (seed, position) alone, not of how
    many draws came before: a request that is recomputed (preempted, or re-admitted after its
    manager restarted) goes on with the tokens it would have drawn anyway. The two are mixed
    by splitmix64's finaliser, so nearby seeds and positions give unrelated streams.
    """
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return generator.manual_seed(z ^ (z >> 31))


@dataclass(slots=True)
class _BatchParams:
    """Per-row parameter vectors, built once per call on the logits' device."""

    greedy: list[bool]
    penalised: list[bool]
    temperature: torch.Tensor  # (S,) float32
    top_k: torch.Tensor        # (S,) int64; V where off
    top_p: torch.Tensor        # (S,) float32
    min_p: torch.Tensor        # (S,) float32
    repetition: torch.Tensor   # (S,) float32
    presence: torch.Tensor     # (S,) float32
    frequency: torch.Tensor    # (S,) float32

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab: int, device: torch.device):
        def vec(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            greedy=[p.greedy for p in params],
            penalised=[p.has_penalties for p in params],
            temperature=vec([p.temperature for p in params]),
            top_k=vec([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64),
            top_p=vec([p.top_p for p in params]),
            min_p=vec([p.min_p for p in params]),
            repetition=vec([p.repetition_penalty for p in params]),
            presence=vec([p.presence_penalty for p in params]),
            frequency=vec([p.frequency_penalty for p in params]),
        )


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)   # what min_tokens holds back, with stop_token_ids

    def __call__(
        self,
        logits: torch.Tensor,                               # (S, V) float32 / bf16 / fp16
        params: Sequence[SamplingParams],                   # S
        prompt_ids: Sequence[TokenIds] | None = None,       # S; read for penalised rows only
        output_ids: Sequence[TokenIds] | None = None,       # S; read for penalised rows only
        generators: Sequence[torch.Generator | None] | None = None,  # S; None: unseeded
        matchers: Sequence | None = None,                   # S; a structured output's matcher, or None
        num_outputs: Sequence[int] | None = None,           # S; output tokens so far; None: output_ids' lengths
    ) -> SamplerOutput:
        num_rows, vocab = logits.shape
        if len(params) != num_rows:
            raise ValueError(f"got {len(params)} SamplingParams for {num_rows} rows of logits")
        shaped = [bool(p.logit_bias) or (p.min_tokens > 0 and _outputs(output_ids, num_outputs, i) < p.min_tokens)
                  for i, p in enumerate(params)]
        formatted = [i for i, m in enumerate(matchers or ()) if m is not None]
        if not any(shaped) and not formatted and all(p.greedy and not p.has_penalties for p in params):
            tokens = row_argmax(logits)                                   # (S,)
            return SamplerOutput(tokens.tolist(), _logprobs(logits, tokens, params))

        batch = _BatchParams.build(params, vocab, logits.device)
        x = logits.to(torch.float32, copy=any(batch.penalised) or any(shaped) or bool(formatted))   # (S, V)
        if formatted:   # every token that would leave the format
            mask_rows(x, formatted, [matchers[i] for i in formatted])
        if any(shaped):
            self._shape(x, params, output_ids, num_outputs, shaped)
        if any(batch.penalised):
            x = _penalise(x, batch, prompt_ids, output_ids)

        tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
        greedy = _indices(batch.greedy, logits.device)
        sampled = _indices([not g for g in batch.greedy], logits.device)
        if greedy.numel():   # every row greedy (shaped or penalised): the argmax where x is, no copy
            tokens[greedy] = row_argmax(x if greedy.numel() == num_rows else x[greedy])
        if sampled.numel():
            rows = sampled.tolist()
            gens = [generators[i] for i in rows] if generators is not None else [None] * len(rows)
            tokens[sampled] = _sample(
                x if len(rows) == num_rows else x[sampled],
                batch.temperature[sampled],
                batch.top_k[sampled],
                batch.top_p[sampled],
                batch.min_p[sampled],
                gens,
            )
        return SamplerOutput(tokens.tolist(), _logprobs(x, tokens, params))


    def _shape(self, x: torch.Tensor, params: Sequence[SamplingParams], output_ids, num_outputs,
               shaped: list[bool]) -> None:
        """In place, before penalties: each row's logit_bias added; EOS (unless ignored) and
        stop_token_ids masked while the row has fewer output tokens than its min_tokens."""
        for i, p in enumerate(params):
            if not shaped[i]:
                continue
            if p.logit_bias:
                ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.int64, device=x.device)
                x[i].index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=x.dtype, device=x.device))
            if p.min_tokens > 0 and _outputs(output_ids, num_outputs, i) < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
                if banned:
                    ids = torch.tensor(banned, dtype=torch.int64, device=x.device)
                    kept = x[i, ids].clone()
                    x[i, ids] = float("-inf")
                    if not bool(torch.isfinite(x[i]).any()):   # a format that allows only these: it ends
                        x[i, ids] = kept


def _outputs(output_ids, num_outputs, i: int) -> int:
    """Output tokens row i has so far (none known: 0)."""
    if num_outputs is not None:
        return num_outputs[i]
    return 0 if output_ids is None else len(output_ids[i])


def _penalise(x, batch: _BatchParams, prompt_ids, output_ids) -> torch.Tensor:
    if prompt_ids is None or output_ids is None:
        raise ValueError("rows with penalties need prompt_ids and output_ids")
    rows = [i for i, p in enumerate(batch.penalised) if p]
    idx = torch.tensor(rows, device=x.device)
    apply_penalties(
        x,
        idx,
        [prompt_ids[i] for i in rows],
        [output_ids[i] for i in rows],
        batch.repetition[idx],
        batch.presence[idx],
        batch.frequency[idx],
    )
    return x


def _sample(
    logits: torch.Tensor,       # (R, V) float32, penalised
    temperature: torch.Tensor,  # (R,)
    top_k: torch.Tensor,        # (R,) int64; V = off
    top_p: torch.Tensor,        # (R,)
    min_p: torch.Tensor,        # (R,)
    generators: list[torch.Generator | None],
) -> torch.Tensor:              # (R,) int64
    vocab = logits.shape[1]
    scaled = logits / temperature.unsqueeze(1)                            # (R, V)
    if bool((top_k < vocab).any() or (top_p < 1).any()):
        scaled.masked_fill_(top_k_top_p_mask(logits, scaled, top_k, top_p), float("-inf"))
    if bool((min_p > 0).any()):
        scaled.masked_fill_(min_p_mask(scaled, min_p), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)                                 # (R, V)
    return row_argmax(probs.div_(exponential_noise(probs.shape, generators, probs.device)))


def top_k_top_p_mask(
    logits: torch.Tensor,  # (R, V) before temperature: top-k ranks these
    scaled: torch.Tensor,  # (R, V) logits / temperature: top-p's probabilities come from these
    top_k: torch.Tensor,   # (R,) int64; >= V is off
    top_p: torch.Tensor,   # (R,); 1.0 is off
) -> torch.Tensor:         # (R, V) bool, True where the token is dropped
    """Top-k, then top-p over the survivors (renormalised).

    Both are thresholds on values, so ties never depend on sort order: top-k keeps every token
    whose logit reaches the k-th largest (HF and vLLM do the same; top_k=1 is the argmax unless
    the maximum is tied); top-p keeps, in order of probability, the tokens while the mass ranked
    before them is below top_p, plus any token tied with the last one kept. Rows with top_p == 1
    are never touched by top-p (a float cumsum may reach 1.0 early).
    """
    vocab = logits.shape[1]
    k_on = top_k < vocab                                                  # (R,)
    drop = torch.zeros_like(logits, dtype=torch.bool)                     # (R, V)
    if bool(k_on.any()):
        drop = logits < _kth_largest(logits, top_k, k_on)
    p_on = top_p < 1                                                      # (R,)
    if bool(p_on.all()):
        probs = torch.softmax(scaled.masked_fill(drop, float("-inf")), dim=-1)  # (R, V)
        drop |= probs < _top_p_cutoff(probs, top_p)
    elif bool(p_on.any()):
        rows = torch.nonzero(p_on).squeeze(1)                             # (P,)
        probs = torch.softmax(scaled[rows].masked_fill_(drop[rows], float("-inf")), dim=-1)
        drop[rows] |= probs < _top_p_cutoff(probs, top_p[rows])
    return drop


# Rows are ranked for top-k in groups of like k: one row's k of 150,000 made every row of the
# batch rank that many (several times the step's sampling time, for every request in it).
_TOP_K_GROUPS = (64, 1024)


def _kth_largest(
    logits: torch.Tensor,  # (R, V)
    top_k: torch.Tensor,   # (R,) int64
    k_on: torch.Tensor,    # (R,) bool: top_k < V
) -> torch.Tensor:         # (R, 1) each row's k-th largest logit; -inf where top-k is off
    """Each group of rows ranks as many as its largest k asks; past half the vocabulary the k-th
    largest is found as the (V - k + 1)-th smallest, so no row ranks more than half of it. The
    values (not their order) decide, so a row's result does not depend on its group."""
    num_rows, vocab = logits.shape
    kth = torch.full((num_rows, 1), float("-inf"), dtype=logits.dtype, device=logits.device)
    bounds = (0, *(b for b in _TOP_K_GROUPS if b < vocab // 2), vocab // 2, vocab)
    for low, high in zip(bounds, bounds[1:]):
        rows = torch.nonzero(k_on & (top_k > low) & (top_k <= high)).squeeze(1)
        if not rows.numel():
            continue
        ks = top_k[rows].unsqueeze(1)                                     # (G, 1)
        of = logits if rows.numel() == num_rows else logits[rows]         # (G, V)
        if high <= vocab // 2:
            ranked = of.topk(int(ks.max()), dim=-1).values                # descending
            kth[rows] = ranked.gather(1, ks - 1)
        else:
            from_below = vocab - ks + 1                                   # (G, 1) <= V / 2
            ranked = of.topk(int(from_below.max()), dim=-1, largest=False).values   # ascending
            kth[rows] = ranked.gather(1, from_below - 1)
    return kth


# Candidate-set sizes tried for top-p before sorting a whole row: the nucleus of a real model's
# distribution usually fits in the first, and a partial top-k is far cheaper than a sort on CPU.
_TOP_P_CANDIDATES = (256, 4096)


def _top_p_cutoff(
    probs: torch.Tensor,  # (P, V) after top-k (dropped tokens have 0)
    top_p: torch.Tensor,  # (P,) in (0, 1)
) -> torch.Tensor:        # (P, 1) the smallest probability top-p keeps
    """Walk the most likely tokens in descending order; a token is kept while the mass before it
    is below top_p. Only the first `size` tokens are looked at; a row is settled once one of them
    is dropped (every later token has at least as much mass before it), otherwise it retries with
    a larger candidate set. The prefix sums do not depend on `size`, so neither does the result.
    Only row-wise kernels are used (softmax, topk, cumsum), never a reduction that torch may split
    across threads for one long row, so a row's result does not depend on the batch around it.
    """
    num_rows, vocab = probs.shape
    cutoff = torch.empty(num_rows, 1, dtype=probs.dtype, device=probs.device)
    pending = torch.arange(num_rows, device=probs.device)                # rows not settled yet
    for size in (*(s for s in _TOP_P_CANDIDATES if s < vocab), vocab):
        rows = probs if pending.numel() == num_rows else probs[pending]   # (n, V)
        values = rows.topk(size, dim=-1).values                           # (n, size) descending
        mass_before = values.cumsum(dim=-1).roll(1, dims=-1)              # (n, size) exclusive
        mass_before[:, 0] = 0
        kept = (mass_before < top_p[pending].unsqueeze(1)).sum(dim=-1, keepdim=True)  # (n, 1) >= 1
        settled = (kept < size).squeeze(1) | (size == vocab)              # (n,)
        cutoff[pending[settled]] = values.gather(1, kept - 1)[settled]
        pending = pending[~settled]
        if not pending.numel():
            break
    return cutoff


def min_p_mask(
    scaled: torch.Tensor,  # (R, V) logits after temperature (and any earlier masks)
    min_p: torch.Tensor,   # (R,); 0 is off
) -> torch.Tensor:         # (R, V) bool, True where the token is dropped
    """Drop tokens with p < min_p * p_max, i.e. logit - max_logit < log(min_p).

    Computed on logits, so no softmax is needed; log(0) = -inf leaves min_p=0 rows untouched.
    """
    gap = scaled - scaled.max(dim=-1, keepdim=True).values                # (R, V) <= 0
    return gap < torch.log(min_p).unsqueeze(1)


def exponential_noise(
    shape: torch.Size,
    generators: Sequence[torch.Generator | None],  # one per row
    device: torch.device,
) -> torch.Tensor:  # (R, V) i.i.d. Exp(1), > 0
    """-log(1 - U) with U uniform; row i comes from generators[i] alone when it has one, other
    rows share one draw. (Uniforms then a log are several times faster than `exponential_`.)
    """
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        if not seeded:
            noise.uniform_()
        else:
            unseeded = _indices([g is None for g in generators], device)
            noise[unseeded] = torch.rand(unseeded.numel(), shape[1], device=device)
    for i in seeded:  # unavoidable per-row loop: one draw per generator
        noise[i].uniform_(generator=generators[i])
    return exponential_from_uniform(noise, zero_is_top=device.type == "cuda")


_NOISE_FLOOR = 2.0 ** -25
_NOISE_CEILING = 64.0   # float32 uniforms below 1 give noise below 17


def exponential_from_uniform(
    u: torch.Tensor,    # uniforms in [0, 1), overwritten
    zero_is_top: bool,  # 0 stands for 1 (CUDA's uniform_: it maps curand's (0, 1] to [0, 1) so)
) -> torch.Tensor:      # -log(1 - U): Exp(1), in [2^-25, 64]
    """Where U = 0 cannot stand for 0 alone:
    - CPU float32 uniforms are multiples of 2^-24, so U = 0 (once in 2^24 cells) stands for all of
      [0, 2^-24): its noise is taken as 2^-25, that interval's middle. Clamped to float32's
      tiniest instead, any token of nonzero probability won at that cell, however unlikely (on a
      large vocabulary, often: docs/benchmarks.md); 0 would also turn a masked token's 0
      probability into NaN.
    - CUDA's U = 0 is curand's 1: the largest noise, which no token should win with.
    """
    noise = u.neg_().log1p_().neg_()
    if zero_is_top:
        return noise.masked_fill_(noise == 0, _NOISE_CEILING).clamp_(max=_NOISE_CEILING)
    return noise.clamp_(_NOISE_FLOOR, _NOISE_CEILING)


def _logprobs(
    logits: torch.Tensor,   # (S, V) penalised, before temperature
    tokens: torch.Tensor,   # (S,) chosen ids
    params: Sequence[SamplingParams],
) -> list[TokenLogprobs | None]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return out
    idx = torch.tensor(rows, device=logits.device)
    picked = logits if len(rows) == len(params) else logits[idx]          # (R, V)
    logprobs = torch.log_softmax(picked.float(), dim=-1)                  # (R, V)
    chosen_ids = tokens[idx]                                              # (R,)
    chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)       # (R,)
    n = min(max(params[i].logprobs for i in rows), logprobs.shape[1])
    top_vals, top_ids = logprobs.topk(n, dim=-1)                          # (R, n), descending
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for j, (i, token_id, logprob) in enumerate(zip(rows, chosen_ids.tolist(), chosen.tolist())):
        k = params[i].logprobs
        out[i] = TokenLogprobs(token_id, logprob, list(zip(top_ids[j][:k], top_vals[j][:k])))
    return out


def _indices(flags: list[bool], device: torch.device) -> torch.Tensor:
    return torch.tensor([i for i, f in enumerate(flags) if f], dtype=torch.int64, device=device)
