"""A request's own cache_salt (vLLM's): its pages are shared only with requests of the same salt,
whatever else they share; salts no request may carry are refused."""

from __future__ import annotations

import grpc
import pytest

from tests.service.util import generate, greedy, request

PROMPT = list(range(400, 464))   # 64 tokens: 16 full pages at the tests' page size


def cached(stub, salt: str, prompt=PROMPT) -> int:
    msg = request(token_ids=prompt, **greedy(2))
    msg.cache_salt = salt
    return generate(stub, msg).prefill.cached_tokens


def test_a_salted_request_shares_pages_only_with_its_salt(stub):
    assert cached(stub, "alice") == 0
    assert cached(stub, "alice") > 0        # the same salt finds its pages
    assert cached(stub, "bob") == 0         # another salt does not
    assert cached(stub, "") == 0            # nor does a request without one
    assert cached(stub, "") > 0
    assert cached(stub, "alicE") == 0       # salts compare exactly
    other = list(range(500, 564))
    assert cached(stub, "", other) == 0 and cached(stub, "carol", other) == 0   # an unsalted one's pages neither


@pytest.mark.parametrize("salt, words", [("a\x00b", "cache_salt must not contain NUL characters"),
                                         ("s" * 257, "cache_salt has 257 bytes of UTF-8; at most 256"),
                                         ("é" * 129, "cache_salt has 258 bytes of UTF-8; at most 256")])
def test_a_salt_no_request_may_carry_is_invalid_argument(stub, salt, words):
    with pytest.raises(grpc.RpcError) as info:
        cached(stub, salt)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()


def test_the_longest_salt_is_taken(stub):
    prompt = list(range(600, 640))
    assert cached(stub, "s" * 256, prompt) == 0 and cached(stub, "s" * 256, prompt) > 0
