import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_service.sampling.detokenizer import IncrementalDetokenizer
from kvserve.model_service.sampling.stop import StopChecker, StopResult

EOS = 0


def _feed(checker, chunks, first_id=10):
    return [checker.step(first_id + i, text) for i, text in enumerate(chunks)]


def test_stop_string_spanning_tokens_is_never_streamed():
    results = _feed(StopChecker(stop_strings=["STOP"]), ["Hel", "lo S", "TO", "P and more"])
    assert [r.text for r in results] == ["Hel", "lo ", "", ""]
    assert results[-1] == StopResult("", True, "stop", "STOP")
    assert not any(r.finished for r in results[:-1])


def test_text_before_a_stop_string_in_the_same_token_is_released():
    results = _feed(StopChecker(stop_strings=["\n\n"]), ["a\n", "b\n\nc"])
    assert [r.text for r in results] == ["a", "\nb"]
    assert results[-1].finish_reason == "stop" and results[-1].stop_reason == "\n\n"


def test_held_text_is_released_once_it_cannot_start_a_stop_string():
    checker = StopChecker(stop_strings=["STOP"])
    results = _feed(checker, ["ab", "S", "T", "x"])
    assert [r.text for r in results] == ["ab", "", "", "STx"]
    assert checker.held_text == ""


def test_the_earliest_stop_string_wins_then_the_shortest():
    results = _feed(StopChecker(stop_strings=["bc", "abc", "ab"]), ["xabcd"])
    assert results[-1] == StopResult("x", True, "stop", "ab")


def test_the_longest_possible_start_is_held():
    checker = StopChecker(stop_strings=["abab", "b!"])
    assert checker.step(1, "xaba").text == "x"  # "aba" may start "abab"
    assert checker.held_text == "aba"
    assert checker.step(2, "c").text == "abac"


def test_eos_stops_and_releases_held_text():
    checker = StopChecker(stop_strings=["XY"], eos_token_ids=[EOS])
    assert checker.step(5, "aX").text == "a"
    result = checker.step(EOS, "")   # (its caller passes no text of the EOS's own)
    assert result == StopResult("X", True, "stop", EOS)


def test_text_earlier_tokens_left_with_an_eos_is_searched_for_stop_strings():
    """With an EOS its caller passes the text the detokenizer still held (a character earlier
    tokens completed only now): released, or, where it completes a stop string, stopped there."""
    checker = StopChecker(stop_strings=["XY"], eos_token_ids=[EOS])
    assert checker.step(5, "aX").text == "a"
    assert checker.step(EOS, "Yb") == StopResult("", True, "stop", "XY")
    checker = StopChecker(stop_strings=["XY"], eos_token_ids=[EOS])
    assert checker.step(5, "aX").text == "a"
    assert checker.step(EOS, "\ufffd") == StopResult("X\ufffd", True, "stop", EOS)


def test_ignore_eos_keeps_going_but_stop_token_ids_still_stop():
    checker = StopChecker(stop_token_ids=[7], eos_token_ids=[EOS], ignore_eos=True)
    assert checker.step(EOS, "") == StopResult("")
    assert checker.step(3, "x") == StopResult("x")
    assert checker.ends_by_id(7) and not checker.ends_by_id(EOS)
    assert checker.step(7, "") == StopResult("", True, "stop", 7)


def test_max_tokens_finishes_with_length_and_releases_everything():
    checker = StopChecker(stop_strings=["STOP"], max_tokens=2)
    assert checker.step(1, "a").text == "a"
    assert checker.step(2, "ST") == StopResult("ST", True, "length", None)


def test_a_stop_on_the_last_allowed_token_is_a_stop_not_a_length():
    assert _feed(StopChecker(stop_strings=["b"], max_tokens=1), ["ab"])[-1] == \
        StopResult("a", True, "stop", "b")
    assert StopChecker(eos_token_ids=[EOS], max_tokens=1).step(EOS, "").finish_reason == "stop"


def test_step_after_finishing_raises():
    checker = StopChecker(max_tokens=1)
    checker.step(1, "a")
    with pytest.raises(RuntimeError):
        checker.step(2, "b")


def test_empty_stop_strings_are_rejected():
    with pytest.raises(ValueError):
        StopChecker(stop_strings=["ok", ""])


def _expected_stream(chunks, stops, min_tokens=0):
    """What a client must see: generation ends at the first token past min_tokens whose text
    completes a stop string; the output is then cut where the earliest stop string that ends in
    that token's text begins (one completed within min_tokens is text like any other)."""
    text = ""
    for k, chunk in enumerate(chunks, 1):
        before = len(text)
        text += chunk
        if k > min_tokens:
            starts = [i for i in (text.find(s, max(0, before - len(s) + 1)) for s in stops) if i >= 0]
            if starts:
                return text[: min(starts)], True
    return text, False


@settings(max_examples=500, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=30),
    stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=6), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=12),
    min_tokens=st.sampled_from([0, 0, 1, 2, 4]),
)
def test_streamed_text_is_the_text_up_to_the_first_stop_string(text, stops, cuts, min_tokens):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    expected, stopped = _expected_stream(chunks, stops, min_tokens)

    checker = StopChecker(stop_strings=stops, max_tokens=len(chunks), min_tokens=min_tokens)
    streamed = ""
    for i, chunk in enumerate(chunks):
        result = checker.step(i + 1, chunk)
        streamed += result.text
        # Never ahead of the first stop string, not even by part of it.
        assert expected.startswith(streamed)
        if result.finished:
            break
        # and never behind it by more than the longest tail that may still begin one
        seen = "".join(chunks[:i + 1])
        assert checker.held_text == max((seen[len(seen) - k:] for s in stops for k in range(1, len(s))
                                         if k <= len(seen) and seen.endswith(s[:k])), key=len, default="")
    assert result.finished and streamed == expected
    if stopped:
        assert result.finish_reason == "stop" and result.stop_reason in stops
        assert text.startswith(result.stop_reason, len(expected))
    else:
        assert result.finish_reason == "length"


def test_within_min_tokens_a_stop_string_is_text_as_vllm_takes_it():
    """vLLM checks stop strings only past min_tokens; kvserve ended the request at once."""
    checker = StopChecker(stop_strings=["ab", "xaby"], min_tokens=2)
    assert [r.text for r in _feed(checker, ["ab ", "xab"])] == ["ab ", ""]   # "xab" may begin "xaby"
    assert checker.step(3, "z") == StopResult("xabz", False)   # "ab" completed within min_tokens: text
    checker = StopChecker(stop_strings=["STOP"], min_tokens=1)
    assert checker.step(1, "ST").text == ""                   # held across the boundary
    assert checker.step(2, "OP!") == StopResult("", True, "stop", "STOP")


def test_a_stop_string_completing_first_wins_over_one_starting_earlier():
    # " aa" starts before "a" but could only complete later; generation ends at "a".
    checker = StopChecker(stop_strings=["a", " aa"])
    assert checker.step(1, " a") == StopResult(" ", True, "stop", "a")


def test_with_the_detokenizer_on_real_tokens(tokenizer):
    text = "你好，世界！这是一个测试。Mixed: hello 世界 🌍 done. The end"
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    checker = StopChecker(stop_strings=["世界 🌍", "never"], eos_token_ids=[tokenizer.eos_token_id])
    streamed = []
    for token_id in output_ids:
        result = checker.step(token_id, detok.add([token_id]))
        streamed.append(result.text)
        if result.finished:
            break
    assert "".join(streamed) == "你好，世界！这是一个测试。Mixed: hello "
    assert result.stop_reason == "世界 🌍"
    assert len(streamed) < len(output_ids)  # stopped before the end
