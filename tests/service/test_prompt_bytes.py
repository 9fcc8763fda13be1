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
       continuation=st.lists(st.integers(0, 2**31 - 1), max_size=50), seed=st.integers(0, 2**64 - 1),
       cache_salt=_text)
def test_the_bound_is_never_over_and_close(prompt, request_id, session_id, stop, continuation, seed, cache_salt):
    msg = pb.GenerateRequest(request_id=request_id, prompt=prompt, session_id=session_id, cache_salt=cache_salt,
                             sampling=pb.SamplingParams(stop=stop, seed=seed, max_tokens=7, temperature=0.5),
                             continuation=pb.TokenIds(ids=continuation))
    real = len(prompt.encode())
    assert real - 24 <= _prompt_bytes(msg) <= real
    tok = pb.TokenizeRequest(prompt=prompt, add_special_tokens=False)
    assert real - 24 <= _prompt_bytes(tok) <= real


def _builder(max_prompt_chars: int):
    """A RequestBuilder with only what check_limits reads (no model, no tokenizer)."""
    from types import SimpleNamespace

    from kvserve.model_service.request_builder import RequestBuilder
    builder = RequestBuilder.__new__(RequestBuilder)
    builder.config = SimpleNamespace(max_prompt_chars=max_prompt_chars, max_chat_messages=64, max_stop_strings=16,
                                     attention_sink=False)
    builder.stack = SimpleNamespace(max_model_len=1 << 20)
    builder.bytes_per_token, builder.chat_keeps_text = None, True
    return builder


def test_every_text_one_character_past_the_limit_or_more_is_refused():
    """The bound read from encoded sizes is a little under the text's length; deciding whether to
    count characters from it let texts up to ~20 characters over the limit through."""
    import pytest

    from kvserve.model_service.request_builder import RequestError
    builder = _builder(100)
    for n in range(90, 130):
        prompt = pb.GenerateRequest(prompt="a" * n, request_id="r" * 30, sampling=pb.SamplingParams(stop=["x"]))
        chat = pb.GenerateRequest(messages=pb.ChatMessages(messages=[
            pb.ChatMessage(role="user", content="a" * (n // 2)), pb.ChatMessage(role="user", content="a" * (n - n // 2))]))
        for msg in (prompt, chat):
            if n <= 100:
                builder.check_limits(msg, "id")
            else:
                with pytest.raises(RequestError, match=f"have {n} characters|has {n} characters"):
                    builder.check_limits(msg, "id")


def test_a_session_id_longer_than_the_gateways_limit_is_refused_at_a_worker_too():
    import pytest

    from kvserve.model_service.request_builder import RequestError
    from kvserve.model_service.request_ids import MAX_SESSION_ID_CHARS
    builder = _builder(100)
    builder.check_limits(pb.GenerateRequest(prompt="a", session_id="s" * MAX_SESSION_ID_CHARS), "id")
    with pytest.raises(RequestError, match="the session id has 257 characters; at most 256"):
        builder.check_limits(pb.GenerateRequest(prompt="a", session_id="s" * 257), "id")


def test_a_role_past_64_characters_is_refused_before_any_rendering():
    """A role is rendered and tokenized whole, and no limit counted it: megabytes of it held the
    tokenizer lanes every tenant shares."""
    import pytest

    from kvserve.model_service.request_builder import RequestError
    builder = _builder(100)
    ok = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="r" * 64, content="hi")]))
    builder.check_limits(ok, "id")
    long = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi"),
                                                                 pb.ChatMessage(role="r" * 7_000_000, content="")]))
    with pytest.raises(RequestError, match=r"messages\[1\].role has 7,000,000 characters; at most 64"):
        builder.check_limits(long, "id")
    named = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi",
                                                                                 name="n" * 100_000)]))
    with pytest.raises(RequestError, match=r"messages\[0\].name has 100,000 characters; at most 64"):
        builder.check_limits(named, "id")


def test_a_speakers_name_is_not_counted_as_the_messages_text():
    """The bytes read from encoded sizes are a bound below the text's: a name's bytes are not
    the content's, and counted as such they refused a chat that fits the model."""
    builder = _builder(1 << 30)
    builder.stack.max_model_len = 8
    builder.bytes_per_token = 4
    named = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi",
                                                                                 name="n" * 64)]))
    builder.check_limits(named, "id")


def test_a_prompt_too_long_for_the_model_is_told_its_bytes_as_the_bound_they_are():
    """The byte count read from encoded sizes is a little under the text's: said as "at least"."""
    import pytest

    from kvserve.model_service.request_builder import RequestError
    builder = _builder(1 << 30)
    builder.stack.max_model_len = 64
    builder.bytes_per_token = 4
    msg = pb.GenerateRequest(prompt="a" * 1000, request_id="r" * 30)
    with pytest.raises(RequestError, match=r"^the prompt has at least 9\d\d bytes, so at least 2\d\d tokens; "
                                           r"the model length is 64$"):
        builder.check_limits(msg, "id")
