"""Per-request sampling parameters: the core's mirror of `kvserve.inference.v1.SamplingParams`.

The servicer converts the proto into this dataclass at the edge (unset optionals become the
defaults below) and calls `validate(vocab_size)`; a ValueError maps to INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from kvserve.model_service.sampling.structured import Format

# Below this temperature a row is sampled greedily: dividing logits by a smaller number can
# overflow float32, and the distribution is already one-hot in all but name (vLLM's choice).
GREEDY_TEMPERATURE = 1e-5
MAX_N = 16         # sequences per request: the default of --max-n
MAX_LOGPROBS = 20  # top-n logprobs per token: OpenAI's limit, and the default of --max-logprobs
_MAX_SEED = 2**64  # the proto's seed is a uint64
# A penalty of 1e-45 divides a logit of 1 into inf, and the softmax into NaN; a hundredfold either
# way is far past any use (HF's and vLLM's examples stay within 1-2).
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_LOGIT_BIAS = 1024   # logit_bias entries per request
MAX_STOP_TOKEN_IDS = 1024   # stop_token_ids per request: each masked in every step while min_tokens holds


def _float32(x: float) -> float:
    """x as the nearest float32 (what a proto float field holds)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    # 1.0 samples the model's distribution as is; 0 (anything below GREEDY_TEMPERATURE) is greedy.
    temperature: float = 1.0
    # Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches top_p.
    # 1.0 keeps everything (off); must lie in (0, 1].
    top_p: float = 1.0
    # Keep only the k most likely tokens; 0 is off (a k above the vocabulary is off too).
    top_k: int = 0
    # Drop tokens whose probability is below min_p times the most likely token's; 0 is off.
    min_p: float = 0.0
    # HF semantics over prompt + output tokens: a seen token's logit is divided by the penalty
    # when positive, multiplied when negative. 1.0 is off; > 1 discourages repeats. Bounded
    # (REPETITION_PENALTY_RANGE) so that the division cannot overflow float32 into NaN logits.
    repetition_penalty: float = 1.0
    # OpenAI semantics over output tokens only: logit -= presence * (count > 0)
    # + frequency * count. 0 is off; both lie in [-2, 2].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Same seed, same tokens, whatever else is in the batch. None draws from the shared stream.
    seed: int | None = None
    # None: up to the model length (the engine enforces that bound).
    max_tokens: int | None = None
    # Token ids that end the request besides EOS; their text is never streamed.
    stop_token_ids: tuple[int, ...] = ()
    # Stop strings; neither they nor any part of them is ever streamed.
    stop: tuple[str, ...] = ()
    # Keep going past EOS (EOS stays sampleable); stop_token_ids still stop.
    ignore_eos: bool = False
    # None: no logprobs; n: the chosen token's logprob plus the top n (0: the chosen one only).
    logprobs: int | None = None
    # Leave special tokens (BOS, EOS, chat markers) out of the streamed text.
    skip_special_tokens: bool = True
    # Sequences sampled in parallel from the prompt (engine/family.py).
    n: int = 1
    # None: none; n: each prompt token's logprob given the tokens before it, plus the top n
    # there (0: the prompt token's only). The prompt is then computed whole, never read from
    # the prefix cache.
    prompt_logprobs: int | None = None
    # (token id, bias) pairs added to those tokens' logits before penalties (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # EOS and stop_token_ids are masked until this many output tokens (vLLM's min_tokens).
    min_tokens: int = 0
    # The output held to a format (structured.py); None: free text.
    format: Format | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience; tuples keep the dataclass hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "logit_bias", tuple(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int, max_logprobs: int = MAX_LOGPROBS, max_n: int = MAX_N) -> None:
        """Raise ValueError naming the first bad field and its value."""
        _check_int(self.n, "n", f"an integer in [1, {max_n}]")
        _check(1 <= self.n <= max_n, "n", self.n, f"an integer in [1, {max_n}] (--max-n)")
        _check(self.temperature >= 0, "temperature", self.temperature, "a finite number >= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check_int(self.top_k, "top_k", "an integer >= 0")
        _check(self.top_k >= 0, "top_k", self.top_k, "an integer >= 0")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        low, high = REPETITION_PENALTY_RANGE
        # (the proto's float32 holds 0.01 as 0.0099999998: the bound as float32 holds it too)
        _check(_float32(low) <= self.repetition_penalty <= high, "repetition_penalty", self.repetition_penalty,
               f"in [{low:g}, {high:g}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, value, "in [-2, 2]")
        if self.seed is not None:
            _check_int(self.seed, "seed", "an integer in [0, 2**64)")
            _check(0 <= self.seed < _MAX_SEED, "seed", self.seed, "an integer in [0, 2**64)")
        if self.max_tokens is not None:
            _check_int(self.max_tokens, "max_tokens", "an integer >= 1")
            _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                top = min(max_logprobs, vocab_size)
                _check_int(value, name, f"an integer in [0, {top}]")
                _check(0 <= value <= top, name, value, f"an integer in [0, {top}] (--max-logprobs)")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids):,} entries; at most {MAX_STOP_TOKEN_IDS} "
                             "are allowed")
        for token_id in self.stop_token_ids:
            _check_int(token_id, "stop_token_ids", f"token ids in [0, {vocab_size})")
            _check(0 <= token_id < vocab_size, "stop_token_ids", token_id,
                   f"token ids in [0, {vocab_size})")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop must hold non-empty strings, got {text!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        for token_id, bias in self.logit_bias:
            _check_int(token_id, "logit_bias", f"keyed by token ids in [0, {vocab_size})")
            _check(0 <= token_id < vocab_size, "logit_bias", token_id, f"keyed by token ids in [0, {vocab_size})")
            _check(-100 <= bias <= 100, f"logit_bias[{token_id}]", bias, "in [-100, 100]")
        _check_int(self.min_tokens, "min_tokens", "an integer >= 0")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"at most max_tokens ({self.max_tokens})")
        if self.format is not None:
            self.format.validate()


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    # NaN fails every comparison, so `ok` is False for it too; infinities are rejected here.
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{name} must be {expected}, got {_shown(value)}")


def _shown(value: object) -> str:
    """`value` as a person wrote it: a proto float field's 0.001 arrives as 0.0010000000474974513,
    and is shown as the shortest decimal that is the same float32."""
    if not isinstance(value, float) or not math.isfinite(value) or _float32(value) != value:
        return repr(value)
    for digits in range(1, 10):
        nearest = float(f"{value:.{digits}g}")
        if _float32(nearest) == value:
            return repr(nearest)
    return repr(value)


def _check_int(value: object, name: str, expected: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
