"""The asyncio client against the live model service: the same results as the sync client, the
same errors, cancellation both ways, and the same TLS and key options."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.clients.async_client import AsyncInferenceClient
from kvserve.clients.inference_client import (
    Chunk, ClientTLS, Completion, Finished, InferenceClient, KVServeError, PrefillDone,
)
from tests.clients.conftest import API_KEY, RPC_TIMEOUT_S

PROMPT = ("The cache page holds the key and value vectors of sixteen tokens, and the server keeps "
          "every full page in a prefix tree")
LONG = 1500   # tokens: far more than a test waits for, so the request is still running when cancelled


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, RPC_TIMEOUT_S))


def test_same_greedy_tokens_and_results_as_the_sync_client(model_server, client: InferenceClient) -> None:
    want = client.complete(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)

    async def go():
        async with AsyncInferenceClient(model_server.address, timeout=RPC_TIMEOUT_S) as c:
            events = [e async for e in c.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)]
            done = await c.complete(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
            tokenized = await c.tokenize(PROMPT)
            return events, done, tokenized, await c.detokenize(tokenized.token_ids), await c.model_info(), \
                await c.server_stats()

    events, done, tokenized, text, info, stats = run(go())
    assert isinstance(events[0], PrefillDone) and isinstance(events[-1], Finished)
    assert tuple(t for e in events if isinstance(e, Chunk) for t in e.token_ids) == want.token_ids
    assert isinstance(done, Completion)
    assert (done.text, done.token_ids, done.finished.completion_tokens) == \
        (want.text, want.token_ids, want.finished.completion_tokens)
    assert tokenized == client.tokenize(PROMPT) and text == PROMPT
    assert info == client.model_info()
    assert stats.prompt_tokens > 0 and stats.kvcache is not None


def test_cancelling_the_stream_aborts_the_request(model_server) -> None:
    async def go():
        async with AsyncInferenceClient(model_server.address, timeout=RPC_TIMEOUT_S) as c:
            aborted = (await c.server_stats()).requests_aborted
            stream = c.generate(PROMPT, max_tokens=LONG, temperature=0, ignore_eos=True)
            first = await stream.__anext__()
            stream.cancel()
            with pytest.raises(KVServeError) as err:
                await stream.__anext__()
            while (await c.server_stats()).requests_aborted == aborted:   # bounded by run()'s deadline
                await asyncio.sleep(0.02)
            return first, err.value

    first, err = run(go())   # returning at all: the server counted the request aborted
    assert isinstance(first, PrefillDone)
    assert err.code == "CANCELLED"   # what the sync client raises too


def test_a_stream_dropped_after_a_break_aborts_the_request(model_server) -> None:
    async def go():
        async with AsyncInferenceClient(model_server.address, timeout=RPC_TIMEOUT_S) as c:
            aborted = (await c.server_stats()).requests_aborted
            async for _ in c.generate(PROMPT, max_tokens=LONG, temperature=0, ignore_eos=True):
                break   # nothing holds the stream now
            while (await c.server_stats()).requests_aborted == aborted:   # bounded by run()'s deadline
                await asyncio.sleep(0.02)
            stats = await c.server_stats()
            while stats.running or stats.waiting:
                await asyncio.sleep(0.02)
                stats = await c.server_stats()
    run(go())


def test_a_client_closed_under_a_stream_ends_it_with_a_kvserve_error(model_server) -> None:
    async def go():
        c = AsyncInferenceClient(model_server.address, timeout=RPC_TIMEOUT_S)
        stream = c.generate(PROMPT, max_tokens=LONG, temperature=0, ignore_eos=True)
        await stream.__anext__()
        await c.close()
        with pytest.raises(KVServeError) as err:
            async for _ in stream:
                pass
        return err.value

    assert run(go()).code == "CANCELLED"


def test_cancel_by_request_id(model_server) -> None:
    async def go():
        async with AsyncInferenceClient(model_server.address, timeout=RPC_TIMEOUT_S) as c:
            stream = c.generate(PROMPT, max_tokens=LONG, temperature=0, ignore_eos=True, request_id="async-cancel")
            first = await stream.__anext__()
            await c.cancel("async-cancel")
            rest = [e async for e in stream]
            with pytest.raises(KVServeError) as unknown:
                await c.cancel("async-cancel")   # no longer in flight
            return first, rest, unknown.value

    first, rest, unknown = run(go())
    assert isinstance(first, PrefillDone) and first.request_id == "async-cancel"
    assert isinstance(rest[-1], Finished) and rest[-1].reason == "abort"
    assert rest[-1].completion_tokens < LONG
    assert unknown.code == "NOT_FOUND"


def test_a_cancelled_task_still_gets_cancelled_error(model_server) -> None:
    """Cancelling the task that reads a stream is asyncio's business, not a KVServeError."""
    async def go():
        async with AsyncInferenceClient(model_server.address, timeout=RPC_TIMEOUT_S) as c:
            stream = c.generate(PROMPT, max_tokens=LONG, temperature=0, ignore_eos=True)
            started = asyncio.Event()

            async def read_all():
                async for _ in stream:
                    started.set()

            task = asyncio.create_task(read_all())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    run(go())


def test_errors_are_kvserve_errors(model_server) -> None:
    async def go():
        async with AsyncInferenceClient(model_server.address, timeout=RPC_TIMEOUT_S) as c:
            with pytest.raises(KVServeError) as bad:
                await c.complete(PROMPT, max_tokens=100_000)
        async with AsyncInferenceClient("127.0.0.1:1", timeout=5) as c:
            with pytest.raises(KVServeError) as down:
                await c.model_info()
        return bad.value, down.value

    bad, down = run(go())
    assert bad.code == "INVALID_ARGUMENT"
    assert down.code == "UNAVAILABLE"


def test_tls_and_api_key(mtls_server, keyed_server, certs, client: InferenceClient) -> None:
    want = client.complete(PROMPT, max_tokens=8, temperature=0, ignore_eos=True).token_ids
    mine = ClientTLS(certs.ca, certs.client.cert, certs.client.key)

    async def go():
        async with AsyncInferenceClient(mtls_server.address, timeout=RPC_TIMEOUT_S, tls=mine) as c:
            over_tls = await c.complete(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
        async with AsyncInferenceClient(keyed_server.address, timeout=RPC_TIMEOUT_S) as c:
            with pytest.raises(KVServeError) as no_key:
                await c.complete(PROMPT, max_tokens=8)
        async with AsyncInferenceClient(keyed_server.address, timeout=RPC_TIMEOUT_S, api_key=API_KEY) as c:
            keyed = await c.complete(PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
        return over_tls.token_ids, no_key.value, keyed.token_ids

    over_tls, no_key, keyed = run(go())
    assert over_tls == keyed == want
    assert no_key.code == "UNAUTHENTICATED"


def test_a_client_closed_under_a_single_answer_call_ends_it_with_a_kvserve_error(model_server) -> None:
    """As a stream does: a bare CancelledError out of a task nobody cancelled reads, to gather,
    TaskGroup or wait_for, as a cancellation of their own."""
    async def go():
        c = AsyncInferenceClient(model_server.address, timeout=RPC_TIMEOUT_S)
        calls = [asyncio.ensure_future(c.tokenize(PROMPT * 2000)) for _ in range(4)]
        await asyncio.sleep(0)   # each on its way
        await c.close()
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = run(go())
    assert not any(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
    assert all(o.code == "CANCELLED" for o in outcomes if isinstance(o, KVServeError))
