"""Parallel sampling: one request, n sequences (SamplingParams.n), the prompt computed once.

The request itself is sequence 0, the *parent*; sequences 1 .. n-1 are its *children*. The
parent prefills all of its prompt but the last token and stops there; in the next step each
child forks from it through the manager (the full pages shared, the partial last page copied
on write, a slot for the last prompt token of its own) and every sequence computes that last
token itself, so each samples its first token from its own logits with its own randomness.
The parent goes past its fork point only once no child is left unforked: until then its KV
cache holds the prompt and nothing else, which is what a fork must copy. A child that cannot fork
in that step (the step's token budget or sequence cap is spent, or no page is free: forks never
preempt) is admitted as a request of its own instead, so no parent ever waits on room that other
parents hold; it finds the prompt's full pages in the prefix cache. From then on each child is an
ordinary request to the scheduler (preempted, swapped, re-admitted from its own tokens).

A prompt of one token has nothing to share: its children are admitted as requests of their
own. Sequence i > 0 of a seeded request draws as a request with the seed child_seed(seed, i)
would; sequence 0 as the request itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvserve.model_service.engine.request import Request

_MASK64 = (1 << 64) - 1
CHILD_SEPARATOR = "\x01"   # never in a client's request id (request_builder refuses control characters)


def child_seed(seed: int, index: int) -> int:
    """The seed sequence `index` draws with: the request's own for 0, then splitmix64 steps."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(eq=False)
class Family:
    """The n sequences of one request; the parent is members[0]."""
    members: list[Request]
    live: int = 0                     # members not yet finished
    prefill_sent: bool = False        # PrefillDone goes once, with the first token of any member
    aborted: bool = False             # a member ended by cancel: the request counts as aborted
    unforked: list[Request] = field(default_factory=list)   # children waiting for the fork point

    @property
    def parent(self) -> Request:
        return self.members[0]


def spawn(parent: Request, n: int, make_generator) -> Family:
    """The family of `parent` with n-1 children (not yet forked). `make_generator(seed)` gives a
    seeded child its generator."""
    family = Family([parent], live=n)
    parent.family = family
    for index in range(1, n):
        params = parent.params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=child_seed(params.seed, index))
        child = Request(f"{parent.request_id}{CHILD_SEPARATOR}{index}", parent.prompt_ids, parent.max_tokens,
                        params, extra_key=parent.extra_key, arrival=parent.arrival, order=parent.order)
        child.index, child.family = index, family
        if parent.matcher is not None:   # each sequence goes through the format on its own
            child.matcher, child.forget_format = parent.matcher.deep_copy(), parent.forget_format
        if params.seed is not None:
            child.generator = make_generator(params.seed)
        family.members.append(child)
    if parent.num_prompt > 1:
        family.unforked = family.members[1:]
        parent.fork_at = parent.num_prompt - 1
    return family
