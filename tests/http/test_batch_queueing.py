"""A completion's batch of prompts against a model service that runs one sequence at a time: the
later prompts wait in its queue while the first generates. The front reads the first's tokens
meanwhile; it waited for every prompt's first event before reading any further, so the server
ended the first's stream as left unread (--max-unread-tokens) and the whole batch got a 429.
A batch larger than the server's queue can never be taken at once: a 400, not a 429 to retry."""

from __future__ import annotations

import httpx
import pytest

from tests.service.conftest import ModelServerThread

NEW_TOKENS = 120


@pytest.fixture(scope="module")
def one_at_a_time(tiny_dirs):
    server = ModelServerThread(tiny_dirs["tiny"], http_listen="127.0.0.1:0", max_num_seqs=1, max_waiting=2,
                               max_unread_tokens=40)
    try:
        yield f"http://{server.servicer.http_front.address}/v1"
    finally:
        server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_whose_prompts_queue_behind_each_other_is_answered_whole(one_at_a_time, stream):
    body = {"model": "tiny", "prompt": ["one", "two"], "max_tokens": NEW_TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": stream}
    with httpx.Client(timeout=120) as client:
        model = client.get(f"{one_at_a_time}/models").json()["data"][0]["id"]
        answer = client.post(f"{one_at_a_time}/completions", json={**body, "model": model})
    assert answer.status_code == 200, answer.text
    if stream:
        chunks = [line[len("data: "):] for line in answer.text.splitlines() if line.startswith("data: ")]
        assert chunks[-1] == "[DONE]" and not any('"error"' in c for c in chunks), answer.text[-500:]
        finished = [c for c in chunks if '"finish_reason":"length"' in c.replace(" ", "")]
        assert len(finished) == 2, answer.text[-500:]
    else:
        choices = answer.json()["choices"]
        assert [c["finish_reason"] for c in choices] == ["length", "length"]
        assert answer.json()["usage"]["completion_tokens"] == 2 * NEW_TOKENS


def test_a_batch_larger_than_the_servers_queue_is_a_400_that_says_why(one_at_a_time):
    with httpx.Client(timeout=60) as client:
        model = client.get(f"{one_at_a_time}/models").json()["data"][0]["id"]
        answer = client.post(f"{one_at_a_time}/completions",
                             json={"model": model, "prompt": ["a", "b", "c"], "max_tokens": 2})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["message"] == ("3 prompts in one request; this server queues at most 2 requests at once "
                                "(--max-waiting): send at most that many")
    assert error["param"] == "prompt" and "retry-after" not in answer.headers
