"""The OpenAI-compatible HTTP front, driven by the real `openai` client: completions and chat,
streamed and not, the same greedy tokens as over gRPC, usage with cached tokens, errors in
OpenAI's shapes, keys as Bearer tokens, concurrent clients."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import urllib.error
import urllib.request

import grpc
import httpx
import openai
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.services.plumbing.retry_hints import NO_RETRY_TRAILER
from tests.gateway.conftest import make_fleet
from tests.service.conftest import ModelServerThread
from tests.service.util import generate, request, wait_until

PROMPT = "The quick brown fox jumps over"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def front(tiny_dirs):
    server = ModelServerThread(tiny_dirs["tiny"], http_listen="127.0.0.1:0")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(front):
    with openai.OpenAI(base_url=f"http://{front.servicer.http_front.address}/v1", api_key="none",
                       max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def grpc_text(front, **input_) -> str:
    with grpc.insecure_channel(front.address) as ch:
        msg = request(**{"temperature": 0, "max_tokens": 12, **input_})
        return generate(pb_grpc.InferenceStub(ch), msg).text


def test_models_lists_the_served_model(client, model):
    assert [m.id for m in client.models.list().data] == [model]


def test_completions_give_the_grpc_text_streamed_or_not(front, client, model):
    expected = grpc_text(front, prompt=PROMPT)
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0   # the same prompt a third time


def test_chat_gives_the_grpc_text_and_cached_tokens(front, client, model):
    expected = grpc_text(front, messages=[(m["role"], m["content"]) for m in MESSAGES])
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens_details.cached_tokens > 0
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_errors_come_in_openais_shapes(client, model):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=5)
    assert "'temperature' must be in [0, 2]" in str(bad.value)
    for top_p in (0, 2):   # the range said is the range taken
        with pytest.raises(openai.BadRequestError, match=rf"'top_p' must be in \(0, 1\], got {top_p}"):
            client.completions.create(model=model, prompt=PROMPT, max_tokens=4, top_p=top_p)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-5", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="model length"):   # the server's own check, as 400
        client.completions.create(model=model, prompt=PROMPT, max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.chat.completions.create(model=model, messages=MESSAGES, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {}}}])


def test_raw_http_edges(front):
    base = f"http://{front.servicer.http_front.address}"
    for asked in (f"{base}/health", f"{base}/ping", urllib.request.Request(f"{base}/ping", data=b"")):   # GET, POST
        with urllib.request.urlopen(asked, timeout=10) as r:
            assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    for body, status in ((b"{not json", 400), (b"[1, 2]", 400)):
        req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == status
        assert "message" in json.loads(err.value.read())["error"]
    # a body declared larger than the limit is refused before it is read
    host, port = front.servicer.http_front.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("content-type", "application/json")
    conn.putheader("content-length", str(9 << 20))
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413 and "larger than" in json.loads(response.read())["error"]["message"]
    conn.close()


def test_concurrent_clients_each_get_their_own_answer(front, client, model):
    prompts = [f"{PROMPT} {i}" for i in range(8)]
    expected = [grpc_text(front, prompt=p) for p in prompts]
    got: list[str | None] = [None] * len(prompts)

    def run(i: int) -> None:
        chunks = client.completions.create(model=model, prompt=prompts[i], max_tokens=12, temperature=0, stream=True)
        got[i] = "".join(c.choices[0].text for c in chunks if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == expected


def test_keys_are_bearer_tokens_over_http(tiny_dirs, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("key-a alpha\nkey-b beta\n")
    server = ModelServerThread(tiny_dirs["tiny"], http_listen="127.0.0.1:0", api_keys=str(keys))
    try:
        base = f"http://{server.servicer.http_front.address}/v1"
        with openai.OpenAI(base_url=base, api_key="wrong", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError, match="unknown API key"):
                c.models.list()
        with openai.OpenAI(base_url=base, api_key="key-a", max_retries=0) as a, \
                openai.OpenAI(base_url=base, api_key="key-b", max_retries=0) as b:
            model = a.models.list().data[0].id
            prompt = PROMPT * 4
            first = a.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
            again = a.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
            other = b.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert other.usage.prompt_tokens_details.cached_tokens == 0   # beta never sees alpha's pages
        with openai.OpenAI(base_url=base, api_key="wrong", max_retries=0) as c:   # the served model's name
            with pytest.raises(openai.AuthenticationError, match="unknown API key"):   # is not told without a key
                c.completions.create(model="another", prompt=prompt, max_tokens=2)
        # Without a key, nothing of the body is read: neither its faults nor its size are told.
        for headers, body in [({}, b'{"max_tokens": -5}'), ({}, b"{{{"), ({"Authorization": "Bearer wrong"},
                                                                        b'{"tools": [1]}')]:
            answer = httpx.post(f"{base}/completions", headers=headers, content=body, timeout=10)
            assert answer.status_code == 401, (headers, answer.text)
            assert answer.json()["error"]["code"] == "unauthenticated"
        root = base.removesuffix("/v1")
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5, 6]})):
            assert httpx.post(f"{root}{path}", json=body, timeout=10).status_code == 401
            keyed = httpx.post(f"{root}{path}", json=body, headers={"Authorization": "Bearer key-a"}, timeout=10)
            assert keyed.status_code == 200, keyed.text
        with grpc.insecure_channel(server.address) as ch:   # the RPC as well, without a key
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.InferenceStub(ch).Detokenize(pb.DetokenizeRequest(token_ids=[5]), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        host, port = server.servicer.http_front.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:   # a gigabyte declared, none sent
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1073741824\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 401 ")
        for value in MALFORMED_AUTHORIZATION:   # no key can be it, and gRPC would refuse to send it
            status, answer = _post(server, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}',
                                   {"authorization": value})
            assert status == 401 and "the Authorization header is malformed" in answer["error"]["message"]
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            conn.request("GET", "/v1/models", headers={"authorization": value})
            assert conn.getresponse().status == 401
    finally:
        server.stop()


def test_the_gateway_serves_the_same_http_api(tiny_dirs):
    for fleet in make_fleet(tiny_dirs["tiny"], 2, http_listen="127.0.0.1:0"):
        base = f"http://{fleet.gateway.gateway.http_front.address}/v1"
        with openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60) as c:
            model = c.models.list().data[0].id
            whole = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
            again = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
            chunks = list(again)
            named = c.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
        direct = generate(fleet.stub, request(messages=[(m["role"], m["content"]) for m in MESSAGES],
                                              temperature=0, max_tokens=12)).text
        assert whole.choices[0].message.content == direct
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == direct
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0   # routed to the worker holding it
        expected = generate(fleet.stub, request(prompt=PROMPT, temperature=0, max_tokens=4, logprobs=2)).logprobs
        assert named.choices[0].logprobs.tokens == [lp.token for lp in expected]   # named by the worker, relayed


@pytest.mark.parametrize("body, message", [
    ('{"prompt": "x", "temperature": 1e400}', "finite"),
    ('{"prompt": "x", "temperature": NaN}', "finite"),
    ('{"prompt": "x", "max_tokens": 5000000000}', "max_tokens"),
    ('{"prompt": [1, 99999999999]}', "token id 99999999999"),
    ('{"prompt": [1, -2]}', "token id -2"),
    ('{"prompt": "x", "temperature": 1' + "0" * 400 + '}', "finite"),   # no float holds it
    ('{"prompt": "x", "max_tokens": 1' + "0" * 400 + '}', "max_tokens"),
    ('{"prompt": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + '}', "nests too deep"),
    ('{"prompt": "x", "top_k": 1e300}', "top_k"),
    ('{"prompt": "x", "echo": "yes"}', "'echo' must be true or false"),
    ('{"prompt": "x", "echo": true, "logprobs": 50}', "logprobs"),   # the prompt's too, past --max-logprobs
    ('{"prompt": "x", "best_of": 2}', "not supported"),
    ('{"prompt": "x", "logprobs": 50}', "logprobs"),          # past the server's --max-logprobs
    ('{"prompt": "x", "logprobs": -1}', "logprobs"),
    ('{"prompt": "x", "top_logprobs": 2}', "chat field"),
    ('{"prompt": "x", "logit_bias": {"' + "1" * 5000 + '": 1}}', "is not a token id"),   # past int()'s digits
    ('{"prompt": "x", "logit_bias": {' + ", ".join(f'"{i}": 1' for i in range(1025)) + '}}',
     "'logit_bias' has 1,025 entries; at most 1024 are allowed"),   # counted before the entries are read
    ('{"prompt": "x", "stream": true, "stream_options": {"\\ud800": true}}',
     "'stream_options.\\ud800' is not an option of a stream"),   # a lone surrogate: shown escaped, not a 500
    ('{"prompt": [' + ", ".join(['"a"'] * 256) + '], "stop": [' + ", ".join(['"' + "s" * 3000 + '"'] * 64) + ']}',
     "send fewer prompts at once"),   # each prompt's call would copy the 192 kB of stop strings
    ('{"prompt": "x", "seed": -9223372036854775809}', "seed"),
    ('{"prompt": "x", "stream_options": {"include_usage": true}}', "only allowed when 'stream' is true"),
    ('{"prompt": "x", "model": 5}', "'model' must be a string"),
    ('{"prompt": "x", "max_completion_tokens": 5, "max_tokens": "abc"}', "'max_tokens' must be an integer"),
    ('{"prompt": "x", "max_completion_tokens": 5, "max_tokens": -7}', "'max_tokens' must be in"),
    ('{"prompt": "x", "repetition_penalty": -1}', "'repetition_penalty' must be at least 0, got -1"),   # not None
])
def test_numbers_out_of_range_are_a_400_in_openais_shape(front, body, message):
    req = urllib.request.Request(f"http://{front.servicer.http_front.address}/v1/completions", data=body.encode(),
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400
    assert message in json.loads(err.value.read())["error"]["message"]


def grpc_logprobs(front, top: int, **input_) -> list:
    with grpc.insecure_channel(front.address) as ch:
        msg = request(temperature=0, max_tokens=8, ignore_eos=True, logprobs=top, **input_)
        return generate(pb_grpc.InferenceStub(ch), msg).logprobs


def test_completion_logprobs_are_the_grpc_ones_with_their_tokens_named(front, client, model):
    expected = grpc_logprobs(front, 3, prompt=PROMPT)
    assert len(expected) == 8 and all(lp.token for lp in expected)   # the service names every token
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                      extra_body={"ignore_eos": True})
    streamed = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                              extra_body={"ignore_eos": True}, stream=True))
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    for got in (whole.choices[0].logprobs, parts):
        tokens = got.tokens if not isinstance(got, list) else [t for p in got for t in p.tokens]
        logprobs = got.token_logprobs if not isinstance(got, list) else [x for p in got for x in p.token_logprobs]
        tops = got.top_logprobs if not isinstance(got, list) else [x for p in got for x in p.top_logprobs]
        offsets = got.text_offset if not isinstance(got, list) else [x for p in got for x in p.text_offset]
        assert tokens == [lp.token for lp in expected]
        assert logprobs == pytest.approx([lp.logprob for lp in expected], abs=1e-3)
        assert tops == [{t.token: pytest.approx(t.logprob, abs=1e-3) for t in lp.top} for lp in expected]
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        assert all(len(top) <= 3 and max(top.values()) >= lp for top, lp in zip(tops, logprobs))
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=2).choices[0].logprobs is None


def test_chat_logprobs_come_with_bytes_and_top_logprobs_streamed_or_not(front, client, model):
    expected = grpc_logprobs(front, 2, messages=[(m["role"], m["content"]) for m in MESSAGES])
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = whole.choices[0].logprobs.content
    streamed = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                                   logprobs=True, top_logprobs=2, stream=True,
                                                   extra_body={"ignore_eos": True}))
    parts = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    for got in (content, parts):
        assert [e.token for e in got] == [lp.token for lp in expected]
        assert [e.logprob for e in got] == pytest.approx([lp.logprob for lp in expected], abs=1e-3)
        # a token's bytes: its text's, but where it holds part of a character (its text U+FFFD):
        # the joined bytes are the message's text
        assert all(e.bytes == list(e.token.encode()) for e in got if "\ufffd" not in e.token)
        assert b"".join(bytes(e.bytes) for e in got).decode("utf-8", "replace") == whole.choices[0].message.content
        assert [[t.token for t in e.top_logprobs] for e in got] == [[t.token for t in lp.top] for lp in expected]
    only = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, logprobs=True)
    assert all(e.top_logprobs == [] for e in only.choices[0].logprobs.content)   # the chosen tokens alone
    assert len(only.choices[0].logprobs.content) == only.usage.completion_tokens


def test_each_choice_of_n_carries_its_own_logprobs(front, client, model):
    """n = 2 sampled choices: each choice's tokens and offsets are its own, streamed or not."""
    kw = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, n=2, logprobs=1,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    streamed = list(client.completions.create(**kw, stream=True))
    for choice in whole.choices:
        got = choice.logprobs
        assert len(got.tokens) == 6 and len(got.token_logprobs) == 6 and len(got.top_logprobs) == 6
        assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(6)]
        parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].index == choice.index
                 and c.choices[0].logprobs]
        assert [t for p in parts for t in p.tokens] == got.tokens   # the same seed, the same draws
        assert [o for p in parts for o in p.text_offset] == got.text_offset


def prompt_logprobs(front, top: int, **input_):
    """The PromptLogprobs of a gRPC request for them."""
    with grpc.insecure_channel(front.address) as ch:
        msg = request(temperature=0, max_tokens=2, prompt_logprobs=top, **input_)
        events = generate(pb_grpc.InferenceStub(ch), msg).events
    (done,) = [e.prefill_done for e in events if e.HasField("prefill_done")]
    return done.prompt_logprobs


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(front, client, model):
    """`echo` with `logprobs` and one new token, as lm-evaluation-harness asks for a
    loglikelihood: the choice's text and logprobs begin with the prompt's, the first token's
    logprob null, each other's the server's prompt logprob, then the generated token's; streamed
    or not, from a string or from token ids."""
    shown = prompt_logprobs(front, 2, prompt=PROMPT)
    generated = grpc_logprobs(front, 2, prompt=PROMPT)[:1]
    n = len(shown.tokens) + 1
    tokens = [shown.first_token] + [lp.token for lp in shown.tokens] + [generated[0].token]
    ids = [shown.first_token_id] + [lp.token_id for lp in shown.tokens]
    kw = dict(model=model, max_tokens=1, temperature=0, logprobs=2, echo=True)
    for prompt in (PROMPT, ids):
        whole = client.completions.create(prompt=prompt, **kw).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(prompt=prompt, stream=True, **kw) if c.choices]
        assert whole.text == "".join(c.text for c in chunks)
        assert whole.text.startswith(PROMPT if prompt is PROMPT else shown.text) and len(whole.text) > len(PROMPT)
        for got in (whole.logprobs, [c.logprobs for c in chunks if c.logprobs]):
            joined = (lambda key: getattr(got, key)) if not isinstance(got, list) else (
                lambda key: [x for part in got for x in getattr(part, key)])
            assert joined("tokens") == tokens
            assert joined("token_logprobs")[0] is None and joined("top_logprobs")[0] is None
            assert joined("token_logprobs")[1:n] == pytest.approx([lp.logprob for lp in shown.tokens], abs=1e-5)
            assert joined("token_logprobs")[n] == pytest.approx(generated[0].logprob, abs=1e-5)
            assert joined("top_logprobs")[1:n] == [{t.token: pytest.approx(t.logprob, abs=1e-5) for t in lp.top}
                                                   for lp in shown.tokens]
            assert joined("text_offset") == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text == PROMPT + grpc_text(front, prompt=PROMPT)[:len(plain.choices[0].text) - len(PROMPT)]
    assert plain.choices[0].logprobs is None and plain.usage.completion_tokens == 3
    from_ids = client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert from_ids.choices[0].text == plain.choices[0].text.replace(PROMPT, shown.text, 1)


def vllm_prompt_logprobs(shown, top: int) -> list:
    """vLLM's prompt_logprobs as JSON carries them, from the server's PromptLogprobs."""
    out = [None]
    for lp in shown.tokens:
        ranks = {t.token_id: r for r, t in enumerate(lp.top, 1)}
        entry = {str(lp.token_id): {"logprob": pytest.approx(lp.logprob, abs=1e-5), "rank": ranks.get(lp.token_id),
                                    "decoded_token": lp.token}}
        for r, t in enumerate(lp.top[:top], 1):
            entry.setdefault(str(t.token_id), {"logprob": pytest.approx(t.logprob, abs=1e-5), "rank": r,
                                               "decoded_token": t.token})
        out.append(entry)
    return out


def test_vllms_prompt_logprobs_for_completions_and_chats_streamed_or_not(front, client, model):
    """vLLM's `prompt_logprobs: N`: [null, then per prompt token {id: logprob, rank, text}, the
    token itself first, then the top N]; a completion's on each choice, a chat's on the response,
    and streamed in a chunk of their own before the tokens. With an echo's smaller `logprobs`, the
    echo's top shows that many."""
    shown = prompt_logprobs(front, 3, prompt=PROMPT)
    expected = vllm_prompt_logprobs(shown, 3)
    kw = dict(model=model, prompt=PROMPT, max_tokens=2, temperature=0, n=2, extra_body={"prompt_logprobs": 3})
    whole = client.completions.create(**kw).model_dump()
    assert [c["prompt_logprobs"] for c in whole["choices"]] == [expected, expected]
    assert whole["choices"][0]["text"] == grpc_text(front, prompt=PROMPT, max_tokens=2)
    chunks = [c.model_dump() for c in client.completions.create(stream=True, **kw)]
    firsts = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0].get("prompt_logprobs")]
    assert sorted(c["index"] for c in firsts) == [0, 1] and all(c["prompt_logprobs"] == expected for c in firsts)
    assert chunks.index(next(c for c in chunks if c["choices"] and c["choices"][0]["text"])) > 1   # before tokens
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                       logprobs=1, extra_body={"prompt_logprobs": 3}).model_dump()["choices"][0]
    assert echoed["prompt_logprobs"] == expected
    assert echoed["logprobs"]["top_logprobs"][1:len(shown.tokens) + 1] == [
        {lp.top[0].token: pytest.approx(lp.top[0].logprob, abs=1e-5)} for lp in shown.tokens]

    chat_shown = prompt_logprobs(front, 1, messages=[(m["role"], m["content"]) for m in MESSAGES])
    chat_expected = vllm_prompt_logprobs(chat_shown, 1)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 1}).model_dump()
    assert chat["prompt_logprobs"] == chat_expected and "prompt_logprobs" not in chat["choices"][0]
    streamed = [c.model_dump() for c in client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, temperature=0, stream=True, extra_body={"prompt_logprobs": 1})]
    assert [c["prompt_logprobs"] for c in streamed if c.get("prompt_logprobs")] == [chat_expected]
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0).model_dump()
    assert "prompt_logprobs" not in plain["choices"][0]


def test_vllms_prompt_logprobs_as_a_whole_float_are_that_integer(front):
    """1.0 is 1, as for every integer field (clients compute them as floats)."""
    answers = [_post(front, "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 1, "temperature": 0,
                                                            "prompt_logprobs": top}).encode()) for top in (1, 1.0)]
    assert [status for status, _ in answers] == [200, 200], answers
    assert answers[0][1]["choices"][0]["prompt_logprobs"] == answers[1][1]["choices"][0]["prompt_logprobs"]


@pytest.mark.parametrize("value, message", [(-1, "must be in [0"), (True, "must be an integer"),
                                            (1000, "logprobs")])   # past the server's --max-logprobs
def test_vllms_prompt_logprobs_refusals(front, value, message):
    body = {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": value}
    status, answer = _post(front, "/v1/completions", json.dumps(body).encode())
    assert status == 400 and message in answer["error"]["message"], answer


def test_vllms_stop_token_ids_and_skip_special_tokens_reach_the_server(front, client, model):
    free = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True})
    ids = [lp.token_id for lp in grpc_logprobs(front, 0, prompt=PROMPT)]
    assert free.choices[0].logprobs.tokens == [lp.token for lp in grpc_logprobs(front, 0, prompt=PROMPT)]
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True, "stop_token_ids": [ids[3]]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == ids.index(ids[3]) + 1
    assert stopped.choices[0].stop_reason == ids[3]   # vLLM's: the stop token that ended it
    assert free.choices[0].stop_reason is None   # its length ended it
    kept = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert kept.choices[0].text == grpc_text(front, prompt=PROMPT, skip_special_tokens=False)[:len(kept.choices[0].text)]


def test_logit_bias_and_min_tokens_reach_the_server(front, client, model):
    forced = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0,
                                       logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == grpc_text(front, prompt=PROMPT, logit_bias={77: 100.0}, max_tokens=4,
                                               ignore_eos=True)
    first = grpc_logprobs(front, 0, prompt=PROMPT)[0].token_id
    held = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [first], "min_tokens": 3})
    assert held.usage.completion_tokens >= 3
    for bias, message in [({"x": 1}, "'logit_bias' key 'x' is not a token id"),
                          ({"5": 101}, "'logit_bias' values must be numbers in [-100, 100]; token 5 has 101"),
                          ({"5": "a"}, "'logit_bias' values must be numbers in [-100, 100]; token 5 has a"),
                          ({"99999": 1}, "logit_bias must be keyed by token ids")]:
        status, answer = _post(front, "/v1/completions", json.dumps({"prompt": PROMPT, "logit_bias": bias}).encode())
        assert status == 400 and answer["error"]["message"].startswith(message), answer


def test_structured_outputs_as_openai_and_vllm_ask_for_them(front, client, model):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=32, temperature=0,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "answer", "schema": schema}})
    assert set(json.loads(chat.choices[0].message.content)) == {"ok"} and chat.choices[0].finish_reason == "stop"
    streamed = list(client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=32, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content
    for extra, check in [
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"guided_regex": "[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{4}", t)),
        ({"guided_json": schema}, lambda t: set(json.loads(t)) == {"ok"}),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"guided_grammar": 'start: "a" "b"+'}, lambda t: re.fullmatch("ab+", t)),
    ]:
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, extra_body=extra)
        assert check(got.choices[0].text), (extra, got.choices[0].text)
    for body, message in [
        ({"response_format": {"type": "xml"}}, "'response_format' type is text, json_object or json_schema"),
        ({"response_format": {"type": "json_schema"}}, "'response_format' json_schema needs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "give one structured output, not guided_regex and guided_choice"),
        ({"guided_choice": []}, "'guided_choice' must be a list of non-empty strings"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
         "give one structured output, not structured_outputs.regex and structured_outputs.choice"),
        ({"structured_outputs": {"choice": "b"}}, "'structured_outputs.choice' must be a list of non-empty strings"),
        ({"guided_regex": "("}, "the regex cannot be used: "),
        ({"structured_outputs": {"structural_tag": "{}"}}, "'structured_outputs.structural_tag' is not supported"),
        ({"structured_outputs": {"regex": "[0-9]", "whitespace_pattern": " "}},
         "'structured_outputs.whitespace_pattern' is not supported"),
        ({"structured_outputs": {"grammar": 'start: "a"', "bogus": 1}}, "'structured_outputs.bogus' is not supported"),
        ({"structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"}},
         "'structured_outputs.disable_any_whitespace' must be true or false"),
    ]:
        status, answer = _post(front, "/v1/completions", json.dumps({"prompt": PROMPT, **body}).encode())
        assert status == 400 and answer["error"]["message"].startswith(message), answer
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={
        "structured_outputs": {"regex": "[0-9]{2}", "disable_any_whitespace": True, "whitespace_pattern": None}})
    assert re.fullmatch("[0-9]{2}", got.choices[0].text)


def test_logprobs_of_tokens_a_format_masks_are_json_numbers(front):
    """A masked token's logprob is -inf, which JSON has no number for: -9999.0, as vLLM writes
    it (the reply was a 500, and a stream carried -Infinity)."""
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 5,
            "guided_choice": ["yes", "no"]}

    def strict(constant):
        raise AssertionError(f"{constant} in the JSON")
    status, answer = _post(front, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, answer
    tops = [t["logprob"] for c in answer["choices"][0]["logprobs"]["content"] for t in c["top_logprobs"]]
    assert -9999.0 in tops and all(t >= -9999.0 for t in tops)
    with urllib.request.urlopen(urllib.request.Request(
            f"http://{front.servicer.http_front.address}/v1/chat/completions", method="POST",
            data=json.dumps({**body, "stream": True}).encode(), headers={"content-type": "application/json"}),
            timeout=60) as reply:
        lines = [line for line in reply.read().decode().splitlines() if line.startswith("data: {")]
    assert lines and all(json.loads(line[6:], parse_constant=strict) for line in lines)


@pytest.mark.parametrize("extra", [
    {"best_of": 1}, {"best_of": 2, "n": 2}, {"suffix": ""}, {"response_format": {"type": "text"}},
    {"tool_choice": "none"}, {"tools": [], "tool_choice": "auto"}, {"logit_bias": {}}, {"min_tokens": 0},
    {"include_stop_str_in_output": False}, {"guided_json": None}, {"use_beam_search": False},
    {"modalities": ["text"]}, {"seed": -1}, {"add_special_tokens": True}, {"parallel_tool_calls": True},
    {"return_tokens_as_token_ids": False}, {"stream_options": None}, {"stream_options": {}},
    {"priority": 0}, {"documents": []}, {"reasoning_effort": None}, {"return_token_ids": False},
    {"length_penalty": 1.0}, {"spaces_between_special_tokens": True},
])
def test_fields_at_values_that_ask_for_nothing_are_accepted(front, extra):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra}
    status, answer = _post(front, "/v1/completions", json.dumps(body).encode())
    assert status == 200, answer


@pytest.mark.parametrize("extra", [
    {"best_of": 3}, {"suffix": "x"}, {"tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f"}}]},
    {"include_stop_str_in_output": True}, {"guided_decoding_backend": "xgrammar"},
    {"allowed_token_ids": [40]}, {"allowed_token_ids": []}, {"bad_words": ["the"]}, {"use_beam_search": True},
    {"truncate_prompt_tokens": 1}, {"logits_processors": ["x"]}, {"chat_template": "{{ messages }}"},
    {"modalities": ["audio"]}, {"return_tokens_as_token_ids": True},
    {"prompt_embeds": "AAAA"}, {"web_search_options": {}}, {"audio": {"voice": "alloy", "format": "wav"}},
    # each was a 200 that did not do what it asked
    {"priority": 5}, {"documents": [{"title": "t", "text": "x"}]}, {"reasoning_effort": "low"},
    {"return_token_ids": True}, {"length_penalty": 0.5}, {"spaces_between_special_tokens": False},
])
def test_fields_kvserve_does_not_do_are_refused_by_name(front, extra):
    body = {"prompt": PROMPT, "max_tokens": 2, **extra}
    status, answer = _post(front, "/v1/completions", json.dumps(body).encode())
    (name,) = extra
    assert status == 400 and answer["error"]["message"] == f"'{name}' is not supported by this server"
    assert answer["error"]["param"] == name


@pytest.mark.parametrize("path, extra, words", [
    # each was a 200 that did not do what it asked
    ("/v1/chat/completions", {"add_special_tokens": True}, "'add_special_tokens' is not supported by this server"),
    ("/v1/chat/completions", {"messages": MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[2]: tool calls are not supported by this server"),
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": "true"}},
     "'stream_options.include_usage' must be true or false"),
    ("/v1/completions", {"stream": True, "stream_options": [{"include_usage": True}]},
     "'stream_options' must be an object"),
    ("/v1/chat/completions", {"messages": MESSAGES + [{"role": "tool", "content": "42", "tool_call_id": "c1"}]},
     "messages[2]: tool calls are not supported by this server"),
    ("/v1/completions", {"add_special_tokens": False}, "'add_special_tokens' is not supported by this server"),
    ("/v1/completions", {"add_special_tokens": "no"}, "'add_special_tokens' must be true or false"),
    ("/v1/completions", {"stream": True, "stream_options": {"usage": True}},
     "'stream_options.usage' is not an option of a stream"),
    ("/v1/completions", {"stream_options": {"include_usage": True}},
     "'stream_options' is only allowed when 'stream' is true"),
])
def test_asks_the_front_cannot_answer_are_a_400_naming_them(front, path, extra, words):
    body = {"max_tokens": 2, **({"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}), **extra}
    status, answer = _post(front, path, json.dumps(body).encode())
    assert status == 400 and answer["error"]["message"] == words, answer


def test_a_cache_salt_keeps_a_requests_pages_apart_and_a_request_id_names_it(front, client, model):
    """vLLM's cache_salt and request_id: pages shared only under one salt; the id is the
    request's at the server (one in flight at a time) and in the reply's."""
    prompt = "salted " * 40

    def hit(**extra):
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens
    assert hit(cache_salt="alice") == 0 and hit(cache_salt="alice") > 0
    assert hit(cache_salt="bob") == 0 and hit() == 0
    for salt, words in ((5, "'cache_salt' must be a non-empty string"), ("", "'cache_salt' must be a non-empty string"),
                        ("a\u0000b", "cache_salt must not contain NUL characters")):
        status, answer = _post(front, "/v1/completions", json.dumps(
            {"prompt": PROMPT, "max_tokens": 2, "cache_salt": salt}).encode())
        assert status == 400 and words in answer["error"]["message"], answer
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, extra_body={
        "request_id": "trace-42"})
    assert reply.id == "chatcmpl-trace-42"
    status, answer = _post(front, "/v1/completions", json.dumps(
        {"prompt": PROMPT, "max_tokens": 2, "request_id": 42}).encode())
    assert status == 400 and answer["error"]["message"] == "'request_id' must be a non-empty string"


def test_stream_options_that_ask_for_nothing_are_accepted(client, model):
    # include_obfuscation (on by default at OpenAI) only pads chunks: taken, with no padding
    for options in ({"include_usage": False}, {"continuous_usage_stats": False, "include_obfuscation": True}):
        chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0, stream=True,
                                                stream_options=options))
        assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_a_negative_seed_is_a_seed_as_openai_takes_it(front):
    """OpenAI's seed is an int64: a negative one draws reproducibly, and not as its absolute value."""
    def text(seed):
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": seed, "ignore_eos": True}
        status, answer = _post(front, "/v1/completions", json.dumps(body).encode())
        assert status == 200, answer
        return answer["choices"][0]["text"]
    assert text(-7) == text(-7) != text(7)


def test_the_chat_templates_options_as_vllm_takes_them(front, client, model):
    """add_generation_prompt, continue_final_message and chat_template_kwargs reach the template
    (the prompt's tokens say so); values that cannot be used are a 400 saying why."""
    def prompt_tokens(**extra):
        reply = client.chat.completions.create(model=model, messages=MESSAGES + [{"role": "assistant", "content": "Red"}],
                                               max_tokens=2, temperature=0, extra_body=extra)
        return reply.usage.prompt_tokens
    opened = prompt_tokens()
    assert prompt_tokens(add_generation_prompt=False) == opened - 1            # no <|assistant|>
    assert prompt_tokens(continue_final_message=True) == opened - 2            # nor the last <|end|>
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == opened
    for extra, words in [({"chat_template_kwargs": {"tools": []}}, "template_kwargs may not set tools"),
                         ({"chat_template_kwargs": [1]}, "'chat_template_kwargs' must be an object"),
                         ({"add_generation_prompt": "no"}, "'add_generation_prompt' must be true or false"),
                         ({"continue_final_message": True, "add_generation_prompt": True},
                          "cannot be given with add_generation_prompt true")]:
        status, answer = _post(front, "/v1/chat/completions", json.dumps({"messages": MESSAGES, **extra}).encode())
        assert status == 400 and words in answer["error"]["message"], answer


def test_text_content_parts_are_joined_by_newlines_as_vllm_joins_them():
    """They were joined with nothing: the same chat made another prompt than vLLM's."""
    from kvserve.services.http.translate import request_of
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}]
    msg = request_of("chat", {"messages": [{"role": "user", "content": parts}]})
    assert [m.content for m in msg.messages.messages] == ["Name a colour.\nOne word."]


def test_a_messages_name_reaches_the_request_as_openai_sends_it():
    """It was dropped: a template that renders speakers' names saw another conversation."""
    from kvserve.services.http.translate import HttpError, request_of
    msg = request_of("chat", {"messages": [{"role": "user", "content": "hi", "name": "ann"},
                                           {"role": "user", "content": "hi"}]})
    first, second = msg.messages.messages
    assert first.name == "ann" and not second.HasField("name")
    with pytest.raises(HttpError) as err:
        request_of("chat", {"messages": [{"role": "user", "content": "hi", "name": 7}]})
    assert err.value.status == 400 and err.value.message == "messages[0].name must be a string"


def test_a_schema_nested_past_what_json_can_encode_again_is_a_400():
    """A body parses at a depth its schema cannot be re-encoded at (json.dumps recurses deeper):
    a 400, not a 500 that also closed the client's connection."""
    from kvserve.services.http.translate import HttpError, request_of
    deep: dict = {}
    for _ in range(5000):
        deep = {"a": deep}
    for kind, body in [("chat", {"messages": MESSAGES, "guided_json": deep}),
                       ("chat", {"messages": MESSAGES, "chat_template_kwargs": {"x": deep}}),
                       ("completion", {"prompt": "x", "structured_outputs": {"json": deep}})]:
        with pytest.raises(HttpError) as err:
            request_of(kind, body)
        assert err.value.status == 400 and "nests too deeply" in err.value.message


@pytest.mark.parametrize("body, message", [
    ({"top_logprobs": 2}, "needs 'logprobs': true"),
    ({"logprobs": "yes"}, "true or false"),
    ({"logprobs": True, "top_logprobs": 99}, "logprobs"),   # past the server's --max-logprobs
    ({"echo": True}, "'echo' is a completion field"),
])
def test_chat_logprob_fields_out_of_place_are_a_400(front, body, message):
    data = json.dumps({"messages": MESSAGES, **body}).encode()
    req = urllib.request.Request(f"http://{front.servicer.http_front.address}/v1/chat/completions", data=data,
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400
    assert message in json.loads(err.value.read())["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompts", [1, 3])
def test_a_client_that_leaves_cancels_its_request(front, stream, prompts):
    """A lone prompt's call, or every call of a batch's three."""
    engine = front.servicer.engine
    aborted = engine.counters.aborted
    host, port = front.servicer.http_front.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"prompt": PROMPT if prompts == 1 else BATCH[:prompts], "max_tokens": 1900, "temperature": 0,
                       "ignore_eos": True, "stream": stream})
    conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
    wait_until(lambda: engine.num_live() == prompts, what="its calls running")
    if stream:
        conn.getresponse().readline()   # its first event
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(lambda: engine.num_live() == 0, timeout=30, what="its calls gone")
    assert engine.counters.aborted == aborted + prompts   # cancelled, not run to their 1,900 tokens


@pytest.mark.parametrize("stream", [False, True])
def test_clients_that_leave_while_queued_free_their_places_at_once(tiny_dirs, stream):
    """One request running, the rest waiting: a client that leaves before its first token
    (queued, or not yet prefilled) cancels its call then, not when the engine reaches it, so its
    place in the queue is free for others and its prompt is never computed."""
    server = ModelServerThread(tiny_dirs["tiny"], http_listen="127.0.0.1:0", max_num_seqs=1, max_waiting=3)
    try:
        engine = server.servicer.engine
        host, port = server.servicer.http_front.address.rsplit(":", 1)

        def post(max_tokens: int) -> http.client.HTTPConnection:
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                               "stream": stream})
            conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
            return conn

        running = post(1900)
        wait_until(lambda: engine.num_live() == 1 and engine.num_queued() == 0, what="the long request running")
        leaving = [post(4) for _ in range(3)]
        wait_until(lambda: engine.num_queued() == 3, what="three requests queued behind it")
        for conn in leaving:
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
        wait_until(lambda: engine.num_queued() == 0, timeout=10, what="the queue empty")
        status, body = _post(server, "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode())
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        running.close()
        wait_until(lambda: engine.num_live() == 0, timeout=30, what="the long request ended")
        # the long request's prompt and the last one's: none of the three that left was prefilled
        assert engine.counters.prompt_tokens == 2 * body["usage"]["prompt_tokens"]
        assert engine.counters.aborted == 3 + (engine.counters.finished < 2)
    finally:
        server.stop()


def _post(front, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a raw POST; http.client sends header values as given (latin-1)."""
    host, port = front.servicer.http_front.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", r'{"prompt": "\ud800", "max_tokens": 2}'),
    ("/v1/completions", r'{"prompt": "hi", "stop": "\udfff"}'),
    ("/v1/completions", r'{"prompt": "hi", "user": "\ud800"}'),
    ("/v1/chat/completions", r'{"messages": [{"role": "\ud800", "content": "x"}]}'),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\udc80"}]}'),
])
def test_a_lone_surrogate_in_a_string_is_a_400_not_a_traceback(front, path, body, caplog):
    status, answer = _post(front, path, body.encode())
    assert status == 400 and "lone UTF-16 surrogate" in answer["error"]["message"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_an_unknown_model_is_named_in_the_404_whatever_it_holds(front, model):
    status, answer = _post(front, "/v1/completions", rb'{"prompt": "hi", "model": "x\ud800"}')
    assert status == 404 and "the model `x\\ud800` does not exist" in answer["error"]["message"]
    status, answer = _post(front, "/v1/completions", b'{"prompt": "hi", "model": ["x"]}')
    assert status == 400 and answer["error"]["message"] == "'model' must be a string"


def test_flags_that_are_not_booleans_are_a_400(front):
    for name in ("stream", "ignore_eos", "skip_special_tokens", "echo"):
        for value in ("yes", 1, 1.0):   # 1.0 == True in Python: it reached protobuf, a 500
            status, answer = _post(front, "/v1/completions", json.dumps({"prompt": "hi", name: value}).encode())
            assert status == 400 and answer["error"]["message"] == f"'{name}' must be true or false", (name, value)
    for name in ("add_generation_prompt", "continue_final_message", "logprobs"):
        status, answer = _post(front, "/v1/chat/completions", json.dumps({"messages": MESSAGES, name: 1.0}).encode())
        assert status == 400 and answer["error"]["message"] == f"'{name}' must be true or false", name


def test_a_huge_n_is_refused_by_the_server_before_the_front_builds_anything(front):
    """n is bounded by the server's --max-n; the front used to make a list per choice first (an
    n of 2^32-1 took the process's memory)."""
    status, answer = _post(front, "/v1/completions", b'{"prompt": "hi", "n": 4294967295, "max_tokens": 2}')
    assert status == 400 and "n" in answer["error"]["message"]


MALFORMED_AUTHORIZATION = ["Bearer key\xe9", "bearer\tkey", "Bearer " + "k" * 5000]


@pytest.mark.parametrize("value", MALFORMED_AUTHORIZATION)
def test_without_keys_the_authorization_header_is_not_looked_at(front, value):
    """A proxy in front may send a token of its own (a long JWT): no key is asked for here."""
    status, answer = _post(front, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}',
                           {"authorization": value})
    assert status == 200, answer
    host, port = front.servicer.http_front.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", "/v1/models", headers={"authorization": value})
    assert conn.getresponse().status == 200
    conn.close()


def test_a_body_that_stops_coming_is_a_408(front, monkeypatch):
    from kvserve.services.http import app

    monkeypatch.setattr(app, "BODY_TIMEOUT_S", 1.0)
    host, port = front.servicer.http_front.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n{\"pro")
        answer = b""
        while b"did not arrive" not in answer and (chunk := s.recv(4096)):   # headers and body may part
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer


def test_connections_that_send_no_whole_request_head_are_closed(front, monkeypatch):
    """Nothing at all, or a head that stops halfway: each held a socket forever."""
    from kvserve.services.http import server

    monkeypatch.setattr(server, "HEADERS_TIMEOUT_S", 1.0)
    host, port = front.servicer.http_front.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as silent, \
            socket.create_connection((host, int(port)), timeout=30) as halfway:
        halfway.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        assert silent.recv(1) == b"" and halfway.recv(1) == b""   # closed by the server
    # a kept-alive connection's next requests are served as before
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    for _ in range(3):
        conn.request("GET", "/health")
        response = conn.getresponse()
        assert response.status == 200 and json.loads(response.read()) == {"status": "ok"}
    conn.close()


def test_unknown_paths_and_methods_answer_in_openais_error_shape(front):
    status, answer = _post(front, "/v1/embeddings", b"{}")
    assert status == 404 and answer["error"]["type"] == "not_found_error"
    assert answer["error"]["message"].startswith("no route /v1/embeddings: this server serves /v1/completions")
    host, port = front.servicer.http_front.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/v1/completions")
    response = conn.getresponse()
    assert response.status == 405 and response.getheader("allow") == "POST"
    assert json.loads(response.read())["error"]["message"] == "GET is not allowed on /v1/completions"
    conn.close()


def test_what_vllms_clients_count_on(front, client, model):
    """A completion without max_tokens stops at 16 tokens (OpenAI's and vLLM's default; a base
    model seldom ends by itself); a whole number written as a float is that number; a chat's
    stream opens with empty content; the model is found by id."""
    short = client.completions.create(model=model, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 16 and short.choices[0].finish_reason == "length"
    status, answer = _post(front, "/v1/completions", json.dumps(
        {"prompt": PROMPT, "max_tokens": 3.0, "n": 1.0, "temperature": 0}).encode())
    assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer
    status, answer = _post(front, "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 3.5}).encode())
    assert status == 400 and answer["error"]["message"] == "'max_tokens' must be an integer"
    first = next(iter(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, stream=True)))
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-5")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_give_each_chunk_the_usage_so_far(front, client, model, path):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the prompt's tokens and
    its choice's tokens so far; the last chunk's usage is the whole reply's."""
    body = {"model": model, "max_tokens": 6, "temperature": 0, "n": 2, "seed": 5, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            **({"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT})}
    host, port = front.servicer.http_front.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"content-type": "application/json"})
    lines = conn.getresponse().read().decode().splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    final = chunks[-1]["usage"]
    per_choice = [c for c in chunks if c["choices"]]
    assert per_choice and all("usage" in c for c in per_choice)
    assert {c["usage"]["prompt_tokens"] for c in per_choice} == {final["prompt_tokens"]} and final["prompt_tokens"] > 0
    for index in (0, 1):
        counts = [c["usage"]["completion_tokens"] for c in per_choice if c["choices"][0]["index"] == index]
        assert counts == sorted(counts) and counts[-1] == 6, counts   # growing, to the choice's whole
        assert all(c["usage"]["total_tokens"] == final["prompt_tokens"] + c["usage"]["completion_tokens"]
                   for c in per_choice)
    assert final["completion_tokens"] == 12


def test_a_request_id_in_flight_is_a_409_no_sdk_retries_and_a_hint_becomes_retry_after(front):
    from kvserve.services.http.app import from_rpc
    host, port = front.servicer.http_front.address.rsplit(":", 1)
    running = http.client.HTTPConnection(host, int(port), timeout=60)
    running.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": PROMPT, "max_tokens": 1500, "stream": True, "request_id": "twice", "ignore_eos": True,
         "temperature": 0}).encode(), headers={"content-type": "application/json"})
    reply = running.getresponse()
    assert reply.status == 200 and reply.read(6) == b"data: "   # running now
    again = http.client.HTTPConnection(host, int(port), timeout=60)
    again.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": 2,
                                                               "request_id": "twice"}).encode())
    answer = again.getresponse()
    assert answer.status == 409 and answer.getheader("x-should-retry") == "false"
    running.close()   # the client leaves: its call is cancelled
    full = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                                grpc.aio.Metadata(("retry-after-ms", "2500")), details="every worker is full")
    err = from_rpc(full)
    assert err.status == 429 and err.headers == {"retry-after-ms": "2500", "retry-after": "3"}
    # a request two workers died computing (services/gateway/relay.py): a retry could kill more
    deadly = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(),
                                  grpc.aio.Metadata((NO_RETRY_TRAILER, "1")), details="2 workers failed")
    err = from_rpc(deadly)
    assert err.status == 500 and err.headers == {"x-should-retry": "false"}
    plain = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")
    assert from_rpc(plain).headers is None


BATCH = ["The quick brown fox", "Once upon a time", "In a hole in the ground"]


def test_a_batch_of_prompts_gives_each_its_own_choices_in_order(front, client, model):
    """OpenAI's list of prompts (LangChain's and lm-evaluation-harness's batches): choice
    i * n + j is prompt i's j-th, each the text that prompt alone gives; the usage counts every
    prompt once and every choice's tokens."""
    alone = [grpc_text(front, prompt=p, max_tokens=5) for p in BATCH]
    whole = client.completions.create(model=model, prompt=BATCH, max_tokens=5, temperature=0, n=2,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.text for c in whole.choices] == [text for text in alone for _ in range(2)]
    singles = [client.completions.create(model=model, prompt=p, max_tokens=1, temperature=0) for p in BATCH]
    assert whole.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert whole.usage.completion_tokens == 30 and whole.usage.total_tokens == whole.usage.prompt_tokens + 30
    ids = [[17, 4, 250, 999], [31, 8, 77]]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in by_ids.choices] == [grpc_text(front, token_ids=i, max_tokens=4) for i in ids]
    chunks = list(client.completions.create(model=model, prompt=BATCH, max_tokens=5, temperature=0, n=2,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(6)] == [c.text for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == 30 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({chunk.id for chunk in chunks}) == 1 == len({whole.id})


def test_a_batch_scored_as_lm_evaluation_harness_scores_it(front, client, model):
    """echo with logprobs over a batch: each choice begins with its own prompt and its logprobs."""
    reply = client.completions.create(model=model, prompt=BATCH, max_tokens=1, temperature=0, echo=True, logprobs=1)
    for prompt, choice in zip(BATCH, reply.choices):
        one = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                        logprobs=1)
        assert choice.text == one.choices[0].text and choice.text.startswith(prompt)
        assert choice.logprobs.token_logprobs == one.choices[0].logprobs.token_logprobs


def _sse_chunks(front, body: dict) -> list:
    """A streamed reply's events, [DONE] as the string."""
    host, port = front.servicer.http_front.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"content-type": "application/json"})
        lines = conn.getresponse().read().decode().splitlines()
    finally:
        conn.close()
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_a_streamed_batch_echoes_scores_and_counts_each_prompt_as_the_whole_reply_does(front, client, model):
    """echo, logprobs and continuous usage in a streamed batch: each choice's text and logprobs are
    the non-streamed batch's, and each chunk's usage is its own prompt's tokens and its choice's so far."""
    whole = client.completions.create(model=model, prompt=BATCH, max_tokens=4, temperature=0, echo=True, logprobs=1,
                                      extra_body={"ignore_eos": True})
    events = _sse_chunks(front, {"prompt": BATCH, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1,
                                 "ignore_eos": True, "stream": True,
                                 "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts: dict[int, str] = {}
    logprobs: dict[int, list] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            logprobs.setdefault(c["index"], []).extend((c["logprobs"] or {}).get("token_logprobs") or [])
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]
    for i, c in enumerate(whole.choices):   # (the same up to the float sums of how the steps batched them)
        assert logprobs[i][0] is None is c.logprobs.token_logprobs[0]
        assert logprobs[i][1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-4)
    prompt_tokens = [client.completions.create(model=model, prompt=p, max_tokens=1).usage.prompt_tokens
                     for p in BATCH]
    for index in range(3):
        usages = [c["usage"] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert {u["prompt_tokens"] for u in usages} == {prompt_tokens[index]}
        counts = [u["completion_tokens"] for u in usages]
        assert counts == sorted(counts) and counts[-1] == 4
    assert chunks[-1]["usage"]["completion_tokens"] == 12 == whole.usage.completion_tokens
    assert chunks[-1]["usage"]["prompt_tokens"] == sum(prompt_tokens) == whole.usage.prompt_tokens


def test_a_batch_whose_calls_fail_mid_stream_ends_with_the_error(front, monkeypatch):
    """A forward pass fails once the batch's three prompts decode together (a CUDA error, a bug):
    their calls end INTERNAL, and the stream's last events are that error and [DONE]."""
    runner = front.servicer.engine.runner
    execute, seen = runner.execute, {"n": 0}

    def failing(work):
        if len({w.request.request_id for w in work}) == 3:
            seen["n"] += 1
            if seen["n"] == 8:
                raise RuntimeError("injected failure")
        return execute(work)

    monkeypatch.setattr(runner, "execute", failing)
    events = _sse_chunks(front, {"prompt": BATCH, "max_tokens": 1900, "temperature": 0, "ignore_eos": True,
                                 "stream": True})
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error", events[-3:]
    assert any(c.get("choices") and c["choices"][0]["text"] for c in events[:-2])   # tokens came before it
    wait_until(lambda: front.servicer.engine.num_live() == 0, what="nothing left running")


def test_a_batch_the_server_refuses_in_part_is_refused_whole(front):
    """One prompt the server refuses (too long for the model) is the batch's 400; the calls of
    the others are cancelled, their pages freed."""
    status, answer = _post(front, "/v1/completions", json.dumps(
        {"prompt": [PROMPT, [5] * 5000, PROMPT], "max_tokens": 3}).encode())
    assert status == 400 and "model length" in answer["error"]["message"], answer
    for prompt, words in (([PROMPT] * 257, "at most 256 prompts in one request, got 257"),
                          ([PROMPT, [1, "x"]], "'prompt' must be a string, a list of token ids"),
                          ([PROMPT, []], "'prompt' must be a string, a list of token ids")):
        status, answer = _post(front, "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 2}).encode())
        assert status == 400 and answer["error"]["message"].startswith(words), answer
    wait_until(lambda: front.servicer.engine.num_live() == 0, what="the batch's other calls ended")


def test_the_served_model_name_is_the_one_clients_ask_for(tiny_dirs):
    """--served-model-name: the name vLLM's clients are configured with, not the directory's."""
    server = ModelServerThread(tiny_dirs["tiny"], http_listen="127.0.0.1:0", served_model_name="org/chat-model-v2")
    try:
        with openai.OpenAI(base_url=f"http://{server.servicer.http_front.address}/v1", api_key="none",
                           max_retries=0, timeout=60) as c:
            assert [m.id for m in c.models.list().data] == ["org/chat-model-v2"]
            assert c.models.retrieve("org/chat-model-v2").id == "org/chat-model-v2"   # a name with a slash
            reply = c.completions.create(model="org/chat-model-v2", prompt=PROMPT, max_tokens=2)
            assert reply.model == "org/chat-model-v2" and reply.usage.completion_tokens == 2
            with pytest.raises(openai.NotFoundError, match="this server serves `org/chat-model-v2`"):
                c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    finally:
        server.stop()


def test_browser_origins_are_answered_only_where_allowed(front, tiny_dirs, monkeypatch):
    """--http-allowed-origins: a web UI on that origin may call the API from the browser
    (preflight answered, its answers readable); other origins, and every origin by default, not."""
    preflight = {"Origin": "https://chat.example.com", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    default = f"http://{front.servicer.http_front.address}"
    assert httpx.options(f"{default}/v1/chat/completions", headers=preflight, timeout=10).status_code == 405
    plain = httpx.get(f"{default}/v1/models", headers={"Origin": "https://chat.example.com"}, timeout=10)
    assert "access-control-allow-origin" not in plain.headers
    server = ModelServerThread(tiny_dirs["tiny"], http_listen="127.0.0.1:0",
                               http_allowed_origins="https://chat.example.com, http://localhost:3000")
    try:
        base = f"http://{server.servicer.http_front.address}"
        answer = httpx.options(f"{base}/v1/chat/completions", headers=preflight, timeout=10)
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "https://chat.example.com"
        assert "authorization" in answer.headers["access-control-allow-headers"].lower()
        got = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                         headers={"Origin": "http://localhost:3000"}, timeout=60)
        assert got.status_code == 200 and got.headers["access-control-allow-origin"] == "http://localhost:3000"
        from kvserve.services.http import app

        def broken(*args, **kwargs):
            raise RuntimeError("a bug in the front")

        monkeypatch.setattr(app, "Reply", broken)   # the front's own failure: its 500 readable there too
        failed = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                            headers={"Origin": "http://localhost:3000"}, timeout=60)
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        assert failed.headers["access-control-allow-origin"] == "http://localhost:3000"
        # readable there: without it an SDK in the browser retries what the server said not to
        assert "x-should-retry" in failed.headers["access-control-expose-headers"]
        monkeypatch.undo()
        other = httpx.options(f"{base}/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"},
                              timeout=10)
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    finally:
        server.stop()


def test_tokenize_gives_the_ids_the_server_makes(front):
    """vLLM's /tokenize: a prompt, or chat messages through the model's template, as the server
    tokenizes them for Generate."""
    from kvserve.inference.v1 import inference_pb2 as pb
    with grpc.insecure_channel(front.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        by_prompt = stub.Tokenize(pb.TokenizeRequest(prompt=PROMPT), timeout=30)
        chat = pb.TokenizeRequest()
        chat.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES)
        by_chat = stub.Tokenize(chat, timeout=30)
    status, answer = _post(front, "/tokenize", json.dumps({"prompt": PROMPT, "return_token_strs": True}).encode())
    assert status == 200 and answer["tokens"] == list(by_prompt.token_ids) and answer["count"] == len(answer["tokens"])
    assert answer["token_strs"] == list(by_prompt.tokens) and answer["max_model_len"] > 0
    status, answer = _post(front, "/tokenize", json.dumps({"messages": MESSAGES, "model": "tiny"}).encode())
    assert status == 200 and answer["tokens"] == list(by_chat.token_ids) and answer["token_strs"] is None
    for body, code, words in (({"prompt": 5}, 400, "'prompt' must be a string, or give 'messages'"),
                              ({"prompt": "x", "model": "gpt-5"}, 404, "does not exist"),
                              ({"messages": MESSAGES, "add_special_tokens": True}, 400, "not supported")):
        status, answer = _post(front, "/tokenize", json.dumps(body).encode())
        assert status == code and words in answer["error"]["message"], answer


def test_version_is_the_installed_packages(front):
    from importlib import metadata

    host, port = front.servicer.http_front.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/version")
    response = conn.getresponse()
    assert response.status == 200 and json.loads(response.read()) == {"version": metadata.version("kvserve")}
    conn.close()


def test_detokenize_gives_the_text_of_the_ids(front):
    """vLLM's /detokenize: a list of ids back to the text /tokenize made them from."""
    status, answer = _post(front, "/tokenize", json.dumps({"prompt": PROMPT}).encode())
    ids = answer["tokens"]
    status, answer = _post(front, "/detokenize", json.dumps({"tokens": ids, "model": "tiny"}).encode())
    assert status == 200 and answer == {"prompt": PROMPT}
    for body, code, words in (({"tokens": "5"}, 400, "'tokens' must be a list of token ids"),
                              ({"tokens": [1, True]}, 400, "'tokens' must be a list of token ids"),
                              ({"tokens": [1, -2]}, 400, "'tokens' must be a list of token ids"),
                              ({"tokens": [1, 1 << 30]}, 400, "outside the vocabulary"),
                              ({"tokens": [1] * ((1 << 17) + 1)}, 400, "131,073 token ids; at most 131,072"),
                              ({"tokens": ids, "skip_special_tokens": 1}, 400, "must be true or false"),
                              ({"tokens": ids, "model": "gpt-5"}, 404, "does not exist")):
        status, answer = _post(front, "/detokenize", json.dumps(body).encode())
        assert status == code and words in answer["error"]["message"], answer


def test_a_gateway_with_no_worker_serving_detokenizes_at_once(tiny_dirs):
    """A gateway answers Detokenize with its own tokenizer: its HTTP front need not wait for a
    worker's model info (up to --no-worker-timeout) unless the body names a model to check."""
    from tests.gateway.conftest import GatewayThread
    from tests.service.processes import free_port

    gateway = GatewayThread([f"127.0.0.1:{free_port()}"], model=str(tiny_dirs["tiny"]),
                            http_listen="127.0.0.1:0", no_worker_timeout_s=60)
    try:
        host, port = gateway.gateway.http_front.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=20)
        conn.request("POST", "/detokenize", body=json.dumps({"tokens": [5, 6, 7]}).encode(),
                     headers={"content-type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and isinstance(json.loads(response.read())["prompt"], str)
        conn.close()
    finally:
        gateway.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(front, stream):
    """Older lm-evaluation-harness and HELM score a prompt with echo and max_tokens 0: the prompt,
    its logprobs, no completion (as vLLM answers it)."""
    body = {"prompt": BATCH[0], "echo": True, "logprobs": 1, "temperature": 0}
    status, scored = _post(front, "/v1/completions", json.dumps({**body, "max_tokens": 1}).encode())
    assert status == 200
    one = scored["choices"][0]
    prompt_part = len(one["logprobs"]["tokens"]) - 1   # the echo's tokens, then the one generated
    if not stream:
        status, answer = _post(front, "/v1/completions", json.dumps({**body, "max_tokens": 0}).encode())
        assert status == 200, answer
        choice = answer["choices"][0]
    else:
        host, port = front.servicer.http_front.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {**body, "max_tokens": 0, "stream": True, "stream_options": {"include_usage": True}}).encode())
        chunks = [json.loads(line[6:]) for line in conn.getresponse().read().decode().splitlines()
                  if line.startswith("data: {")]
        choice = {"text": "".join(c["choices"][0]["text"] for c in chunks if c["choices"]),
                  "finish_reason": chunks[-2]["choices"][0]["finish_reason"],
                  "logprobs": {"token_logprobs": [lp for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                                                  for lp in c["choices"][0]["logprobs"]["token_logprobs"]]}}
        answer = chunks[-1]
    assert choice["text"] == BATCH[0] and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == one["logprobs"]["token_logprobs"][:prompt_part]
    assert answer["usage"]["completion_tokens"] == 0
    assert answer["usage"]["total_tokens"] == answer["usage"]["prompt_tokens"] == scored["usage"]["prompt_tokens"]
    status, refused = _post(front, "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 0}).encode())
    assert status == 400 and "'max_tokens' must be in [1" in refused["error"]["message"]   # without echo


def test_a_drain_closes_idle_connections_and_the_port_and_lets_a_running_stream_finish(tiny_dirs):
    """HTTP's GOAWAY: at the drain's start an idle keep-alive connection is closed and the port
    with it (a client's next request opens a connection that reaches another replica, where it
    got 503 here for the whole drain); a stream under way finishes."""
    import asyncio

    from kvserve.model_service.server import drain

    server = ModelServerThread(tiny_dirs["tiny"], http_listen="127.0.0.1:0")
    try:
        host, port = server.servicer.http_front.address.rsplit(":", 1)
        idle = socket.create_connection((host, int(port)), timeout=30)
        idle.sendall(f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += idle.recv(65536)
        assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower()   # kept alive
        busy = http.client.HTTPConnection(host, int(port), timeout=60)
        busy.request("POST", "/v1/completions", headers={"content-type": "application/json"},
                     body=json.dumps({"prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "stream": True,
                                      "ignore_eos": True}))
        stream = busy.getresponse()
        assert stream.status == 200 and stream.readline().startswith(b"data: ")
        assert server.servicer.engine.num_live() == 1
        draining = asyncio.run_coroutine_threadsafe(drain(server.running, server.servicer, 60.0), server.loop)
        idle.settimeout(30)
        rest = head.split(b"\r\n\r\n", 1)[1]
        while (got := idle.recv(65536)):   # the rest of the body, then the server's close
            rest += got
        idle.close()

        def refused() -> bool:
            try:
                socket.create_connection((host, int(port)), timeout=5).close()
            except ConnectionRefusedError:
                return True
            return False
        wait_until(refused, what="the HTTP port closed")
        body = stream.read().decode()
        assert body.endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in body
        draining.result(60)
    finally:
        server.stop()


def _aborted(front) -> int:
    with grpc.insecure_channel(front.address) as ch:
        return pb_grpc.InferenceStub(ch).GetServerStats(pb.GetServerStatsRequest(), timeout=10).requests_aborted


def test_a_failure_of_the_front_itself_is_an_openai_500_and_leaves_no_call_running(front, monkeypatch):
    """An unexpected exception once the call had started (here, making the reply) was Starlette's
    plain-text 500, and the started Generate ran on to its max_tokens."""
    from kvserve.services.http import app

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the front")

    monkeypatch.setattr(app, "Reply", broken)
    before = _aborted(front)
    status, answer = _post(front, "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 1500}).encode())
    assert status == 500 and answer["error"]["type"] == "server_error"
    assert "RuntimeError" not in json.dumps(answer) and "a bug" not in json.dumps(answer)
    wait_until(lambda: _aborted(front) >= before + 1, what="the started call cancelled")


def test_a_failure_of_the_front_mid_stream_is_the_streams_last_event(front, monkeypatch):
    """An unexpected exception after the 200 went out cut the connection without a word."""
    from kvserve.services.http import app

    async def failing(part, continuous):
        yield [part.reply.choice_chunk("a", None)]
        raise RuntimeError("a bug in the front")

    monkeypatch.setattr(app, "_chunks", failing)
    before = _aborted(front)
    answer = httpx.post(f"http://{front.servicer.http_front.address}/v1/completions", timeout=60,
                        json={"prompt": PROMPT, "max_tokens": 1500, "stream": True})
    assert answer.status_code == 200
    events = [line[len("data: "):] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    assert json.loads(events[1])["error"]["type"] == "server_error" and events[2:] == ["[DONE]"]
    assert "RuntimeError" not in answer.text
    wait_until(lambda: _aborted(front) >= before + 1, what="the streamed call cancelled")


def test_the_fronts_stop_cancels_requests_left_past_its_bound(tiny_dirs, monkeypatch):
    """stop() waits HTTP_STOP_S for the requests in flight; what runs past it is cancelled (its
    call with it, its connection closed) rather than left to the process's exit. Here its client
    stopped reading: the server's socket buffers are small, so its writes back up."""
    from kvserve.services.http import server as http_server

    monkeypatch.setattr(http_server, "HTTP_STOP_S", 0.5)
    server = ModelServerThread(tiny_dirs["tiny"], http_listen="127.0.0.1:0")
    try:
        engine, front_ = server.servicer.engine, server.servicer.http_front
        for listening in front_.server.servers[0].sockets:   # what it accepts inherits it
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        host, port = front_.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.connect()
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": PROMPT, "max_tokens": 1900, "ignore_eos": True, "stream": True}).encode(),
            headers={"content-type": "application/json"})
        answer = conn.getresponse()
        assert answer.readline().startswith(b"data: ")
        wait_until(lambda: engine.num_live() == 0 or any(
            c.transport.get_write_buffer_size() > 0 for c in front_.server.server_state.connections),
            what="its writes backed up")
        server.call(front_.stop(), timeout=30)
        state = front_.server.server_state
        assert front_.task.done() and not state.tasks and not state.connections
        with pytest.raises(http.client.IncompleteRead) as cut:   # its connection closed before the 1,900 tokens
            answer.read()
        assert b"[DONE]" not in cut.value.partial
        wait_until(lambda: engine.num_live() == 0, what="its call cancelled")
        assert engine.counters.aborted == 1
        conn.close()
    finally:
        server.servicer.http_front = None   # stopped already
        server.stop()


def test_the_http_fronts_logit_bias_bound_is_the_servers():
    from kvserve.model_service.sampling.params import MAX_LOGIT_BIAS
    from kvserve.services.http.translate import MAX_LOGIT_BIAS as FRONTS

    assert FRONTS == MAX_LOGIT_BIAS


NOT_SUPPORTED = "is not supported by this server"
# Every parameter of the openai SDK's create(): a value it takes (None), or refused by name.
SDK_CHAT = [
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}, NOT_SUPPORTED),
    ("frequency_penalty", {"frequency_penalty": 0.5}, None),
    ("function_call", {"function_call": "none"}, None),
    ("function_call", {"function_call": {"name": "f"}}, NOT_SUPPORTED),
    ("functions", {"functions": [{"name": "f", "parameters": {}}]}, NOT_SUPPORTED),
    ("logit_bias", {"logit_bias": {"7": 1}}, None),
    ("logprobs", {"logprobs": True, "top_logprobs": 2}, None),
    ("max_completion_tokens", {"max_completion_tokens": 2}, None),
    ("max_tokens", {"max_tokens": 2}, None),
    ("metadata", {"metadata": {"run": "7"}}, None),   # a label: nothing is stored to carry it
    ("modalities", {"modalities": ["text"]}, None),
    ("modalities", {"modalities": ["text", "audio"]}, NOT_SUPPORTED),
    ("moderation", {"moderation": {"model": "omni-moderation-latest"}}, NOT_SUPPORTED),
    ("n", {"n": 2}, None),
    ("parallel_tool_calls", {"parallel_tool_calls": False}, None),
    ("prediction", {"prediction": {"type": "content", "content": "Red"}}, NOT_SUPPORTED),
    ("presence_penalty", {"presence_penalty": 0.5}, None),
    ("prompt_cache_key", {"prompt_cache_key": "conversation-7"}, None),   # as `user`: one worker
    ("prompt_cache_options", {"prompt_cache_options": {"mode": "explicit"}}, NOT_SUPPORTED),
    ("prompt_cache_retention", {"prompt_cache_retention": "in_memory"}, None),
    ("prompt_cache_retention", {"prompt_cache_retention": "24h"}, NOT_SUPPORTED),
    ("reasoning_effort", {"reasoning_effort": "low"}, NOT_SUPPORTED),
    ("response_format", {"response_format": {"type": "json_object"}}, None),
    ("safety_identifier", {"safety_identifier": "a1b2"}, None),
    ("seed", {"seed": 7}, None),
    ("service_tier", {"service_tier": "auto"}, None),
    ("service_tier", {"service_tier": "flex"}, NOT_SUPPORTED),
    ("stop", {"stop": ["\n\n"]}, None),
    ("store", {"store": False}, None),
    ("store", {"store": True}, NOT_SUPPORTED),
    ("stream", {"stream": True, "stream_options": {"include_usage": True}}, None),
    ("stream_options", {"stream": True, "stream_options": {"include_usage": False}}, None),
    ("temperature", {"temperature": 0.5}, None),
    ("tool_choice", {"tool_choice": "none"}, None),
    ("tool_choice", {"tool_choice": "required"}, NOT_SUPPORTED),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}, NOT_SUPPORTED),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 0}, None),
    ("top_p", {"top_p": 0.9}, None),
    ("user", {"user": "alice"}, None),
    ("verbosity", {"verbosity": "low"}, NOT_SUPPORTED),
    ("web_search_options", {"web_search_options": {}}, NOT_SUPPORTED),
]
SDK_COMPLETION = [
    ("best_of", {"best_of": 1}, None),
    ("best_of", {"best_of": 3}, NOT_SUPPORTED),
    ("echo", {"echo": True}, None),
    ("frequency_penalty", {"frequency_penalty": 0.5}, None),
    ("logit_bias", {"logit_bias": {"7": 1}}, None),
    ("logprobs", {"logprobs": 2}, None),
    ("max_tokens", {"max_tokens": 2}, None),
    ("n", {"n": 2}, None),
    ("presence_penalty", {"presence_penalty": 0.5}, None),
    ("seed", {"seed": 7}, None),
    ("stop", {"stop": "\n"}, None),
    ("stream", {"stream": True}, None),
    ("stream_options", {"stream": True, "stream_options": {"include_usage": True}}, None),
    ("suffix", {"suffix": ""}, None),
    ("suffix", {"suffix": " the end"}, NOT_SUPPORTED),
    ("temperature", {"temperature": 0.5}, None),
    ("top_p", {"top_p": 0.9}, None),
    ("user", {"user": "alice"}, None),
]


def test_every_parameter_of_the_openai_sdk_is_taken_or_refused_by_name(client, model):
    """Each documented parameter of chat.completions.create and completions.create; a new one
    in the SDK fails this test until it is decided here (and in translate.py)."""
    import inspect

    from openai.resources.chat.completions import Completions as Chat
    from openai.resources.completions import Completions

    own = {"self", "model", "messages", "prompt", "extra_headers", "extra_query", "extra_body", "timeout"}
    for create, table, first in ((client.chat.completions.create, SDK_CHAT, {"messages": MESSAGES}),
                                 (client.completions.create, SDK_COMPLETION, {"prompt": PROMPT})):
        sdk = Chat.create if table is SDK_CHAT else Completions.create
        assert set(inspect.signature(sdk).parameters) - own == {name for name, _, _ in table}
        for name, kwargs, refusal in table:
            call = {"model": model, **first, "max_tokens": 2, **kwargs}
            if refusal is None:
                reply = create(**call)
                if call.get("stream"):
                    reply = list(reply)
                assert reply, name
                continue
            with pytest.raises(openai.BadRequestError) as err:
                create(**call)
            assert err.value.body["message"] == f"'{name}' {refusal}" and err.value.param == name, name


@pytest.mark.parametrize("path, extra, words", [
    ("/v1/completions", {"max_new_tokens": 5},
     "Unrecognized request argument supplied: max_new_tokens (this server's is 'max_tokens')"),
    ("/v1/chat/completions", {"regex": "[a-z]+"},
     "Unrecognized request argument supplied: regex (this server's is 'guided_regex')"),
    ("/v1/chat/completions", {"ebnf": 'root ::= "a"'},
     "Unrecognized request argument supplied: ebnf (this server's is 'guided_grammar', in Lark's notation)"),
    ("/v1/completions", {"json_schema": {"type": "object"}}, "Unrecognized request argument supplied: json_schema "
     "(this server's is 'response_format' of type json_schema, or 'guided_json')"),
    ("/v1/completions", {"messages": MESSAGES},
     "Unrecognized request argument supplied: messages (a chat's field: POST it to /v1/chat/completions)"),
    ("/v1/chat/completions", {"prompt": PROMPT},
     "Unrecognized request argument supplied: prompt (a completion's field: POST it to /v1/completions)"),
    ("/v1/completions", {"temprature": 0, "top-p": None},   # a null is refused too: no field here is called so
     "Unrecognized request arguments supplied: temprature, top-p"),
    ("/v1/completions", {f"x{i}": 1 for i in range(7)},
     "Unrecognized request arguments supplied: x0, x1, x2, x3, x4, and 2 more"),
    ("/tokenize", {"chat_template": "{{ messages }}"}, "Unrecognized request argument supplied: chat_template"),
    ("/detokenize", {"max_tokens": 2}, "Unrecognized request argument supplied: max_tokens"),
])
def test_fields_an_endpoint_does_not_know_are_refused_in_openais_words(front, path, extra, words):
    """They were dropped: SGLang's regex, TGI's max_new_tokens, a misspelt field did nothing."""
    base = {"/v1/completions": {"prompt": PROMPT, "max_tokens": 2}, "/tokenize": {"prompt": PROMPT},
            "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 2}, "/detokenize": {"tokens": [5, 6]}}
    status, answer = _post(front, path, json.dumps({**base[path], **extra}).encode())
    assert status == 400 and answer["error"]["message"] == words, answer
    assert answer["error"]["param"] == next(iter(extra)) and answer["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("name", ["user", "prompt_cache_key", "safety_identifier"])
def test_an_identifier_that_is_not_a_string_is_a_400(front, name):
    status, answer = _post(front, "/v1/completions", json.dumps({"prompt": PROMPT, name: 5}).encode())
    assert status == 400 and answer["error"]["message"] == f"'{name}' must be a string"
    assert answer["error"]["param"] == name


def test_a_prompt_cache_key_keeps_a_conversation_on_one_worker_as_user_does():
    from kvserve.services.http.translate import request_of
    assert request_of("chat", {"messages": MESSAGES, "user": "ann"}).session_id == "ann"
    assert request_of("chat", {"messages": MESSAGES, "user": "ann", "prompt_cache_key": "c7"}).session_id == "c7"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 50}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "n": 99}, "n"),
])
def test_a_servers_refusal_names_the_clients_field_as_openais_param(front, path, body, param):
    """The server names its own field ("logprobs must be ..."): a chat's was top_logprobs."""
    status, answer = _post(front, path, json.dumps({**body, "max_tokens": 2}).encode())
    assert status == 400 and "(--max-" in answer["error"]["message"], answer
    assert answer["error"]["param"] == param


def test_the_server_tells_its_front_its_bound_on_chat_messages(front):
    """The model service passes its --max-chat-messages to its HTTP front, which refuses a longer
    list by its length before reading a message (its own words, with the thousands' comma)."""
    import httpx

    answer = httpx.post(f"http://{front.servicer.http_front.address}/v1/chat/completions", timeout=60,
                        json={"messages": [{"role": "user", "content": "hi"}] * 1025, "max_tokens": 1})
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "1,025 chat messages; at most 1,024 are allowed (--max-chat-messages)"


def test_the_fronts_own_failure_is_a_500_naming_the_incident_its_log_has(monkeypatch, caplog):
    """The 500's body named no incident, and its log line no id: a client's report could not be
    matched to the traceback."""
    from starlette.testclient import TestClient

    from kvserve.services.http import app as app_module

    async def broken(self, request):
        raise RuntimeError("a bug")
    monkeypatch.setattr(app_module.Front, "version", broken)
    answered = []
    class NeverCalled:   # what the stubs are built from; no call reaches it
        def __getattr__(self, name):
            return lambda *args, **kwargs: None
    channel = NeverCalled()
    with TestClient(app_module.make_app(channel, answered=lambda route, status: answered.append((route, status)))) as c:
        r = c.get("/version")
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    incident = r.json()["error"]["message"].rsplit(" ", 1)[-1]
    assert f"incident {incident}" in caplog.text and "a bug" in caplog.text
    assert answered == [("/version", 500)]
