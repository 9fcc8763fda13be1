"""The sync SDK over TLS, mutual TLS and with API keys, against live model services: a client the
server does not accept gets a KVServeError, one it accepts gets the tokens of a plaintext run."""

from __future__ import annotations

import pytest

from kvserve.clients.inference_client import ClientTLS, InferenceClient, KVServeError
from tests.clients.conftest import API_KEY, RPC_TIMEOUT_S, SERVER_NAME

PROMPT = "The cache page holds the key and value vectors of sixteen tokens"
REFUSED_TIMEOUT_S = 10.0


def greedy(client: InferenceClient) -> tuple[int, ...]:
    return client.complete(PROMPT, max_tokens=8, temperature=0, ignore_eos=True).token_ids


@pytest.fixture(scope="module")
def plain_tokens(model_server) -> tuple[int, ...]:
    with InferenceClient(model_server.address, timeout=RPC_TIMEOUT_S) as c:
        return greedy(c)


def refused(address: str, **options) -> KVServeError:
    with InferenceClient(address, timeout=REFUSED_TIMEOUT_S, **options) as c:
        with pytest.raises(KVServeError) as err:
            greedy(c)
    return err.value


def test_tls_with_the_right_ca(tls_server, certs, plain_tokens) -> None:
    with InferenceClient(tls_server.address, timeout=RPC_TIMEOUT_S, tls=ClientTLS(ca=certs.ca)) as c:
        assert greedy(c) == plain_tokens
        assert c.model_info().vocab_size > 0   # unary calls go over the same channel
    assert refused(tls_server.address).code == "UNAVAILABLE"                                 # plaintext
    assert refused(tls_server.address, tls=ClientTLS(ca=certs.other_ca)).code == "UNAVAILABLE"  # wrong CA
    assert refused(tls_server.address, tls=True).code == "UNAVAILABLE"   # the system's roots do not know it


def test_tls_server_name_override(tls_server, certs, plain_tokens) -> None:
    named = ClientTLS(ca=certs.ca, server_name=SERVER_NAME)
    with InferenceClient(tls_server.address, timeout=RPC_TIMEOUT_S, tls=named) as c:
        assert greedy(c) == plain_tokens
    wrong = ClientTLS(ca=certs.ca, server_name="not-the-server.test")
    assert refused(tls_server.address, tls=wrong).code == "UNAVAILABLE"


def test_mutual_tls(mtls_server, certs, plain_tokens) -> None:
    mine = ClientTLS(certs.ca, certs.client.cert, certs.client.key)
    with InferenceClient(mtls_server.address, timeout=RPC_TIMEOUT_S, tls=mine) as c:
        assert greedy(c) == plain_tokens
    assert refused(mtls_server.address).code == "UNAVAILABLE"
    assert refused(mtls_server.address, tls=ClientTLS(ca=certs.ca)).code == "UNAVAILABLE"   # no certificate
    stranger = ClientTLS(certs.ca, certs.stranger.cert, certs.stranger.key)
    assert refused(mtls_server.address, tls=stranger).code == "UNAVAILABLE"


def test_bad_tls_settings_fail_when_the_client_is_made(certs, tmp_path) -> None:
    with pytest.raises(ValueError, match="cert and key"):
        InferenceClient("127.0.0.1:1", tls=ClientTLS(ca=certs.ca, cert=certs.client.cert))
    with pytest.raises(ValueError, match="cannot read CA certificate"):
        InferenceClient("127.0.0.1:1", tls=ClientTLS(ca=str(tmp_path / "missing.pem")))
    with pytest.raises(ValueError, match="cannot read CA certificate"):   # a Unix socket stays plaintext
        InferenceClient(f"unix://{tmp_path}/s.sock", tls=ClientTLS(ca=str(tmp_path / "missing.pem")))
    with pytest.raises(TypeError):
        InferenceClient("127.0.0.1:1", tls="ca.pem")


def test_api_key(keyed_server, plain_tokens) -> None:
    err = refused(keyed_server.address)
    assert err.code == "UNAUTHENTICATED" and "authorization: Bearer KEY" in err.message
    wrong = refused(keyed_server.address, api_key="not-a-key")
    assert (wrong.code, wrong.message) == ("UNAUTHENTICATED", "unknown API key")
    with InferenceClient(keyed_server.address, timeout=RPC_TIMEOUT_S) as c:   # unary calls too
        with pytest.raises(KVServeError) as stats_err:
            c.server_stats()
        assert stats_err.value.code == "UNAUTHENTICATED"
    with InferenceClient(keyed_server.address, timeout=RPC_TIMEOUT_S, api_key=API_KEY) as c:
        assert greedy(c) == plain_tokens
        assert c.tokenize(PROMPT).token_ids
        assert c.server_stats().prompt_tokens > 0


def test_a_malformed_key_fails_when_the_client_is_made() -> None:
    with pytest.raises(ValueError, match="printable ASCII"):
        InferenceClient("127.0.0.1:1", api_key="two words")
