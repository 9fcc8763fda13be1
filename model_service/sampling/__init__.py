"""Sampling layer of the model service: parameters, the batched sampler, detokenizer, stop rules.

Per engine step, for each running request (see README.md):
    SamplerOutput = Sampler()(logits, params, prompt_ids, output_ids, generators)
    text          = IncrementalDetokenizer.add([token_id])   (+ flush() when the token ends it)
    StopResult    = StopChecker.step(token_id, text)   → stream StopResult.text; finish if told
(engine/output.py does both, in that order.)
"""

from kvserve.model_service.sampling.detokenizer import IncrementalDetokenizer
from kvserve.model_service.sampling.params import SamplingParams
from kvserve.model_service.sampling.sampler import Sampler, SamplerOutput, TokenLogprobs, make_generator
from kvserve.model_service.sampling.stop import StopChecker, StopResult

__all__ = [
    "IncrementalDetokenizer",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "StopChecker",
    "StopResult",
    "TokenLogprobs",
    "make_generator",
]
