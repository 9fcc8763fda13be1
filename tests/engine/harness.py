"""Runs the real engine in-process (no gRPC) and collects each request's events."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve.model_service.assembly import ModelStack, build
from kvserve.model_service.config import ModelServiceConfig
from kvserve.model_service.engine.events import Failed, Finished, PrefillDone, Tokens
from kvserve.model_service.engine.request import Request
from kvserve.model_service.sampling.params import SamplingParams
from kvserve.model_service.sampling.sampler import make_generator


@dataclass
class Outcome:
    request_id: str = ""
    tokens: list[int] = field(default_factory=list)   # sequence 0's
    text: str = ""
    prefill: PrefillDone | None = None
    finished: Finished | None = None                   # sequence 0's
    failure: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    n: int = 1
    sequences: dict[int, list[int]] = field(default_factory=dict)   # index -> tokens
    finishes: dict[int, Finished] = field(default_factory=dict)     # index -> its Finished
    prefills: int = 0

    def sink(self, event) -> None:
        if isinstance(event, PrefillDone):
            self.prefill = event
            self.prefills += 1
        elif isinstance(event, Tokens):
            self.sequences.setdefault(event.index, []).extend(event.token_ids)
            if event.index == 0:
                self.tokens += event.token_ids
                self.text += event.text
        elif isinstance(event, Finished):
            assert event.index not in self.finishes, f"sequence {event.index} finished twice"
            self.finishes[event.index] = event
            if event.index == 0:
                self.finished = event
            if len(self.finishes) == self.n:
                self.done.set()
        elif isinstance(event, Failed):
            self.failure = event.message
            self.done.set()


class EngineHarness:
    def __init__(self, model: Path, wrap_kv=None, **config) -> None:
        """wrap_kv: a function of the stack's KV client giving the one the engine uses (a test
        double that fails on cue, tests/engine/flaky_kv.py)."""
        config.setdefault("kvcache", "inprocess")
        self.stack: ModelStack = build(ModelServiceConfig(model=str(model), **config))
        self.engine = self.stack.engine
        if wrap_kv is not None:
            self.stack.kv = self.engine.link.kv = wrap_kv(self.stack.kv)
        self.engine.start()
        self._n = 0

    def submit(self, prompt_ids: list[int], max_tokens: int = 12, tap=None, **params) -> Outcome:
        """`tap(outcome, event)`, when given, sees each event before the outcome takes it."""
        params.setdefault("temperature", 0.0)
        params.setdefault("ignore_eos", True)
        sp = SamplingParams(max_tokens=max_tokens, **params)
        self._n += 1
        request = Request(f"req-{self._n}", list(prompt_ids), max_tokens, sp)
        if sp.seed is not None:
            request.generator = make_generator(sp.seed, self.stack.device)
        if sp.format is not None:   # as the request builder gives it one
            request.matcher = self.stack.grammars.matcher(sp.format)
            request.forget_format = functools.partial(self.stack.grammars.forget, sp.format)
        outcome = Outcome(request.request_id, n=sp.n)
        sink = outcome.sink if tap is None else lambda event: (tap(outcome, event), outcome.sink(event))
        self.engine.submit(request, sink)
        return outcome

    def run(self, prompts: list[list[int]], max_tokens: int = 12, **params) -> list[Outcome]:
        outcomes = [self.submit(p, max_tokens, **params) for p in prompts]
        wait(outcomes)
        return outcomes

    def stats(self, timeout_s=None):
        assert self.engine.wait_idle(30), "the engine did not go idle"
        return self.stack.kv.stats()

    def close(self) -> None:
        self.engine.stop()


def wait(outcomes: list[Outcome], timeout: float = 120.0) -> None:
    for o in outcomes:
        assert o.done.wait(timeout), "a request did not finish"
        assert o.failure is None, o.failure


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation (EOS ignored) and the top-2 logit margin at each step."""
    with torch.no_grad():
        ids = torch.tensor([prompt], device=hf_model.device)
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0, output_scores=True,
                                return_dict_in_generate=True)
    margins = []
    for scores in out.scores:
        top2 = torch.topk(scores[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return out.sequences[0, len(prompt):].tolist(), margins


def assert_same_tokens(ours: list[int], ref: list[int], margins: list[float], what: str) -> None:
    """Exact equality, except at a near tie (docs/architecture.md): there the two float32
    implementations may legitimately pick different tokens, and the rest differs too."""
    if ours == ref:
        return
    first = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b) if len(ours) == len(ref) else 0
    margin = margins[first] if first < len(margins) else float("inf")
    assert margin < 1e-3, (f"{what}: tokens differ at position {first} where transformers' top-2 logit "
                           f"margin is {margin:.2e} (not a tie)\n ours {ours}\n   hf {ref}")
    print(f"{what}: near tie at position {first} (margin {margin:.2e}); accepted")
