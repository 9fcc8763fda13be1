"""The prompt's byte count read from encoded sizes (request_builder._prompt_bytes) never exceeds
the prompt's real UTF-8 length, whatever else the request carries, and is close to it: a prompt
is refused as too long from it alone."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.model_service.request_builder import _prompt_bytes

_text = st.text(max_size=300)


@settings(max_examples=200, deadline=None)
@given(prompt=_text, request_id=_text, session_id=_text, stop=st.lists(_text, max_size=5),
       continuation=st.lists(st.integers(0, 2**31 - 1), max_size=50), seed=st.integers(0, 2**64 - 1))
def test_the_bound_is_never_over_and_close(prompt, request_id, session_id, stop, continuation, seed):
    msg = pb.GenerateRequest(request_id=request_id, prompt=prompt, session_id=session_id,
                             sampling=pb.SamplingParams(stop=stop, seed=seed, max_tokens=7, temperature=0.5),
                             continuation=pb.TokenIds(ids=continuation))
    real = len(prompt.encode())
    assert real - 24 <= _prompt_bytes(msg) <= real
    tok = pb.TokenizeRequest(prompt=prompt, add_special_tokens=False)
    assert real - 24 <= _prompt_bytes(tok) <= real
