import math

import pytest

from kvserve.model_service.sampling.params import SamplingParams

VOCAB = 100


def test_defaults_are_valid_and_mean_off():
    p = SamplingParams()
    p.validate(VOCAB)
    assert not p.greedy and not p.has_penalties
    assert SamplingParams(temperature=0).greedy


def test_lists_become_tuples():
    p = SamplingParams(stop=["a"], stop_token_ids=[1, 2])
    assert p.stop == ("a",) and p.stop_token_ids == (1, 2)
    hash(p)


def test_edges_that_are_valid():
    SamplingParams(temperature=0, top_p=1.0, top_k=0, min_p=1.0, presence_penalty=-2,
                   frequency_penalty=2, logprobs=20, seed=2**64 - 1, max_tokens=1,
                   stop_token_ids=(0, VOCAB - 1), stop=("x",)).validate(VOCAB)
    SamplingParams(min_p=0.0, logprobs=0, top_k=10**6).validate(VOCAB)


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"temperature": -0.5}, "temperature", "-0.5"),
        ({"temperature": math.nan}, "temperature", "nan"),
        ({"temperature": math.inf}, "temperature", "inf"),
        ({"top_p": 0.0}, "top_p", "0.0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_k": -1}, "top_k", "-1"),
        ({"min_p": -0.1}, "min_p", "-0.1"),
        ({"min_p": 1.01}, "min_p", "1.01"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "0.0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty", "-1.0"),
        ({"repetition_penalty": 1e-45}, "repetition_penalty", "1e-45"),
        ({"repetition_penalty": 1e3}, "repetition_penalty", "1000.0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "2.5"),
        ({"frequency_penalty": -2.1}, "frequency_penalty", "-2.1"),
        ({"logprobs": 21}, "logprobs", "21"),
        ({"logprobs": -1}, "logprobs", "-1"),
        ({"stop_token_ids": (5, VOCAB)}, "stop_token_ids", str(VOCAB)),
        ({"stop_token_ids": (-1,)}, "stop_token_ids", "-1"),
        ({"stop": ("ok", "")}, "stop", "''"),
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"seed": -1}, "seed", "-1"),
        ({"seed": 2**64}, "seed", str(2**64)),
    ],
)
def test_validation_names_field_and_value(kwargs, field, value):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs).validate(VOCAB)
    message = str(exc.value)
    assert message.startswith(field + " ")
    assert value in message


def test_validation_message_is_readable():
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 1\.5$"):
        SamplingParams(top_p=1.5).validate(VOCAB)
    with pytest.raises(ValueError, match=r"^stop_token_ids must be token ids in \[0, 100\), got 100$"):
        SamplingParams(stop_token_ids=(100,)).validate(VOCAB)


def test_a_float_from_the_wire_is_shown_as_it_was_written():
    """A proto float field holds 0.001 as 0.0010000000474974513: the refusal said that."""
    import struct

    wire = struct.unpack("f", struct.pack("f", 0.001))[0]
    with pytest.raises(ValueError, match=r"^repetition_penalty must be in \[0\.01, 100\], got 0\.001$"):
        SamplingParams(repetition_penalty=wire).validate(VOCAB)
    with pytest.raises(ValueError, match=r"^presence_penalty must be in \[-2, 2\], got 2\.3$"):
        SamplingParams(presence_penalty=struct.unpack("f", struct.pack("f", 2.3))[0]).validate(VOCAB)
