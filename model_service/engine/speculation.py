"""Speculative decoding by prompt lookup (`--speculative ngram --num-draft-tokens K`). Policy only.

Drafting. The last n tokens of a sequence (n from NGRAM_MAX down to NGRAM_MIN) are looked up among
its earlier tokens, prompt and output alike; at the first match, the K tokens that followed it are
the draft (the first has the most tokens after it; in a repeating span the latest has one). Each sequence keeps an index of its n-grams, extended as tokens come,
so a lookup costs a few dict probes whatever the sequence's length.

Verifying. The step computes the sequence's last token and its draft, and the target samples at
every one of those positions as it would have without the draft (the same sampler, each position's
own seeded draw, penalties over the tokens before it). The longest prefix of the draft that equals
the target's own samples is accepted, and so is the target's sample after it: 1 to K+1 tokens per
step, each exactly the token decoding without speculation gives (greedy, and seeded sampling,
whose draw depends only on seed and position). For a draft proposed with certainty (a point mass,
as prompt lookup's are), accepting draft token d exactly when the target's sample equals d is the
standard acceptance rule: it accepts with probability p(d), and on rejection the sample is
distributed as p without d, renormalised, which is the rule's residual distribution. So the output
distribution is unchanged, unseeded requests included.

Rolling back. The manager hears of a draft as tokens (in the step's Commit, beyond the computed
count, so no draft token can enter the prefix tree) and gets slots for it; the next Step truncates
the rejected ones, which frees every page past the sequence's new end.

Backing off. A step that drafts cannot be pipelined (its next proposal waits for the verdict), and
a draft that is wrong costs the forward its extra tokens. A sequence whose lookup finds nothing, or
whose draft is mostly rejected, stops drafting for a number of steps that doubles on every such
miss (up to MAX_COOLDOWN) and resets when a draft pays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NGRAM_MIN = 2          # a single matching token predicts the next one poorly
NGRAM_MAX = 4
# The index covers a sequence's last NGRAM_WINDOW to 2 * NGRAM_WINDOW tokens: a stream that runs
# for millions (attention sinks) grew it with every token, and one continued
# from millions indexed them all at once on the engine thread. Rebuilt from the last window
# once it covers two: linear time over the stream, as before.
NGRAM_WINDOW = 65_536
MAX_COOLDOWN = 16      # steps a sequence waits, at most, before it tries again
GOOD_ENOUGH = 0.5      # accepted / drafted at or above this: the draft paid


@dataclass
class DraftState:
    """One sequence's n-gram index and back-off."""
    index: list[dict[tuple[int, ...], int]] = field(
        default_factory=lambda: [{} for _ in range(NGRAM_MAX + 1)])   # n -> n-gram -> end of its first match
    indexed: int = 0       # n-grams ending before this position are in the index
    start: int = 0         # ... and from this one on
    cooldown: int = 0      # steps left without drafting
    miss_streak: int = 0   # consecutive misses: the next cooldown is 2 ** miss_streak


class NgramDrafter:
    def __init__(self, num_draft_tokens: int) -> None:
        if num_draft_tokens <= 0:
            raise ValueError(f"--num-draft-tokens must be positive, got {num_draft_tokens}")
        self.k = num_draft_tokens

    @staticmethod
    def wants(state: DraftState | None) -> bool:
        """Whether the sequence drafts at its next step (else it decodes plainly, pipelined)."""
        return state is None or state.cooldown == 0

    @staticmethod
    def wait(state: DraftState) -> None:
        """A step of its cooldown passed."""
        if state.cooldown:
            state.cooldown -= 1

    def propose(self, state: DraftState, tokens: list[int], room: int) -> list[int]:
        """Up to min(K, room) tokens predicted to follow `tokens`; [] (counted as a miss) when no
        n-gram matches. `room`: tokens the sequence may still add after the next one."""
        limit = min(self.k, room)
        if limit <= 0:
            return []
        _extend(state, tokens)
        end = len(tokens)
        for n in range(min(NGRAM_MAX, end - 1), NGRAM_MIN - 1, -1):
            last = state.index[n].get(tuple(tokens[end - n:]))
            if last is not None:
                return tokens[last + 1:last + 1 + limit]
        self._missed(state)
        return []

    def verdict(self, state: DraftState, drafted: int, accepted: int) -> None:
        """After a verified draft: a draft mostly rejected backs the sequence off."""
        if accepted >= GOOD_ENOUGH * drafted:
            state.miss_streak = 0
        else:
            self._missed(state)

    @staticmethod
    def _missed(state: DraftState) -> None:
        state.cooldown = min(MAX_COOLDOWN, 2 ** state.miss_streak)
        state.miss_streak += 1


def _extend(state: DraftState, tokens: list[int]) -> None:
    """Indexes the n-grams ending at positions indexed .. len-2: every one but the suffix itself,
    which is what a lookup asks for."""
    if len(tokens) - state.start > 2 * NGRAM_WINDOW:   # only the last window's n-grams from now on
        state.start = len(tokens) - NGRAM_WINDOW
        state.indexed = state.start
        state.index = [{} for _ in range(NGRAM_MAX + 1)]
    index = state.index
    for end in range(max(state.indexed, state.start + NGRAM_MIN - 1), len(tokens) - 1):
        for n in range(NGRAM_MIN, min(NGRAM_MAX, end + 1) + 1):
            index[n].setdefault(tuple(tokens[end - n + 1:end + 1]), end)
    state.indexed = max(state.indexed, len(tokens) - 1)


def accepted_prefix(draft: list[int], sampled: list[int]) -> int:
    """How many draft tokens the target's own samples confirm: sampled[j] is the target's token
    at the draft's position j."""
    a = 0
    while a < len(draft) and sampled[a] == draft[a]:
        a += 1
    return a
