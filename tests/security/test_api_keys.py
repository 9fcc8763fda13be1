"""API keys and tenants: no key or an unknown one is refused before any work; health stays open;
each tenant's prefix cache is its own, at a lone model service and through the gateway, whose
hashes are the worker's for every tenant; keys are re-read on SIGHUP."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.kvcache.v1 import kvcache_pb2 as kv_pb
from kvserve.kvcache.v1 import kvcache_pb2_grpc as kv_pb_grpc
from kvserve.services.plumbing.api_keys import ApiKeys
from tests.gateway.conftest import GatewayThread, WorkerThreads, make_fleet
from tests.gateway.test_gateway import tree_hashes
from tests.service.conftest import ModelServerThread
from tests.service.util import generate, greedy, request, rpc_error, wait_until

KEYS = "key-a alpha\nkey-a2 alpha   # a second key of the same tenant\n\nkey-b beta\n"


def bearer(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


def run(stub, ids: list[int], key: str, n: int = 4, **extra):
    out = []
    for event in stub.Generate(request(token_ids=ids, **greedy(n), **extra), metadata=bearer(key), timeout=30):
        out.append(event)
    prefill = next(e.prefill_done for e in out if e.HasField("prefill_done"))
    return prefill.cached_tokens, [t for e in out if e.HasField("chunk") for t in e.chunk.token_ids]


@pytest.fixture(scope="module")
def keyed(tiny_dirs, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(KEYS)
    server = ModelServerThread(tiny_dirs["tiny"], api_keys=str(path))
    try:
        yield server, path
    finally:
        server.stop()


def test_no_key_or_an_unknown_one_is_refused_and_health_stays_open(keyed):
    server, _ = keyed
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        err = rpc_error(lambda: generate(stub, request(token_ids=[5, 6, 7], **greedy(2))))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer KEY" in err.details()
        err = rpc_error(lambda: list(stub.Generate(request(token_ids=[5, 6, 7], **greedy(2)),
                                                   metadata=bearer("nope"), timeout=10)))
        assert (err.code(), err.details()) == (grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
        err = rpc_error(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer("key-b"), timeout=10).vocab_size == 1024
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflection = ProtoReflectionDescriptorDatabase(ch)   # grpcurl's listing needs no key either
        assert "kvserve.inference.v1.Inference" in reflection.get_services()
        # page hashes would let one tenant test a guess at another's prompt: a keyed front has none to give
        events = kv_pb_grpc.KVCacheEventsStub(ch).WatchEvents(kv_pb.WatchEventsRequest(snapshot=True),
                                                               metadata=bearer("key-a"), timeout=10)
        err = rpc_error(lambda: list(events))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "page hashes" in err.details()
        events_health = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="kvserve.kvcache.v1.KVCacheEvents"), timeout=10)
        assert events_health.status == health_pb2.HealthCheckResponse.NOT_SERVING   # as it refuses every call


def test_without_a_key_bytes_that_do_not_parse_are_refused_as_unauthenticated(keyed):
    """The key is looked at before the request: a caller without one learns nothing of it."""
    server, _ = keyed
    with grpc.insecure_channel(server.address) as ch:
        generate_raw = ch.unary_stream("/kvserve.inference.v1.Inference/Generate")
        err = rpc_error(lambda: list(generate_raw(b"\xff\xff\xff\xff", timeout=10)))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        err = rpc_error(lambda: list(generate_raw(b"\xff\xff\xff\xff", metadata=bearer("key-a"), timeout=10)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_tenants_never_share_a_page(keyed):
    server, _ = keyed
    ids = [random.Random(1).randrange(3, 1024) for _ in range(40)]
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        first, tokens = run(stub, ids, "key-a")
        assert first == 0
        again, same = run(stub, ids, "key-a2")   # another key of the same tenant shares its cache
        assert again > 0 and same == tokens
        other, theirs = run(stub, ids, "key-b")
        assert other == 0 and theirs == tokens   # the same tokens, none of alpha's pages
        assert run(stub, ids, "key-a")[0] == again


def test_another_tenants_request_cannot_be_cancelled(keyed):
    server, _ = keyed
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        call = stub.Generate(request(token_ids=[9] * 10, request_id="alpha-1", **greedy(1500)),
                             metadata=bearer("key-a"), timeout=60)
        next(call)
        # each tenant's ids are its own: beta may use alpha's id in flight, and hears nothing of it
        beta = list(stub.Generate(request(token_ids=[9] * 10, request_id="alpha-1", **greedy(3)),
                                  metadata=bearer("key-b"), timeout=60))
        assert beta[0].prefill_done.request_id == "alpha-1" and beta[-1].finished.usage.completion_tokens == 3
        err = rpc_error(lambda: list(stub.Generate(request(token_ids=[9] * 10, request_id="alpha-1", **greedy(3)),
                                                   metadata=bearer("key-a2"), timeout=60)))
        assert (err.code(), err.details()) == (grpc.StatusCode.ALREADY_EXISTS,
                                               "request id 'alpha-1' is already in flight")
        err = rpc_error(lambda: stub.Cancel(pb.CancelRequest(request_id="alpha-1"), metadata=bearer("key-b"),
                                            timeout=10))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        stub.Cancel(pb.CancelRequest(request_id="alpha-1"), metadata=bearer("key-a2"), timeout=10)
        events = list(call)
        assert events[-1].finished.finish_reason == pb.FINISH_REASON_ABORT


def test_a_revoked_keys_stats_stream_ends_at_its_next_message(keyed):
    """A WatchServerStats stream never ends by itself: its key was looked at once, and a key taken
    out of the file (SIGHUP) kept it open, reporting the server's load, for ever."""
    server, path = keyed
    try:
        with grpc.insecure_channel(server.address) as ch:
            stream = pb_grpc.InferenceStub(ch).WatchServerStats(
                pb.WatchServerStatsRequest(interval_ms=20, heartbeat_ms=100), metadata=bearer("key-b"), timeout=30)
            next(stream)
            path.write_text("key-a alpha\n")
            server.servicer.keys.reload()
            err = rpc_error(lambda: list(stream))
            assert (err.code(), err.details()) == (grpc.StatusCode.UNAUTHENTICATED, "the API key was revoked")
    finally:
        path.write_text(KEYS)
        server.servicer.keys.reload()


def test_keys_are_read_again_and_a_broken_file_keeps_those_in_force(tmp_path):
    path = tmp_path / "keys"
    path.write_text(KEYS)
    keys = ApiKeys(str(path))
    assert (keys.tenant("key-a"), keys.tenant("key-b"), keys.tenant("key-c"), keys.tenant(None)) == \
        ("alpha", "beta", None, None)
    path.write_text("key-c gamma\n")
    keys.reload()
    assert (keys.tenant("key-a"), keys.tenant("key-c")) == (None, "gamma")
    path.write_text("key-d\n")   # no tenant: refused, the keys in force stay
    keys.reload()
    assert keys.tenant("key-c") == "gamma"
    for text, message in (("a b c\n", "expected `KEY TENANT`"), ("a x\na y\n", "a key listed twice"),
                          ("# nothing\n", "lists no key"),
                          # what a gateway could not pass on to its workers (every call of it failed)
                          ("key-e équipe\n", "a tenant must be printable ASCII of at most 256"),
                          (f"key-l {'t' * 257}\n", "a tenant must be printable ASCII of at most 256"),
                          ("clé alpha\n", "a key must be printable ASCII")):
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            ApiKeys(str(path))
    path.write_bytes(b"\xffkey alpha\n")
    with pytest.raises(ValueError, match=r"the API key file '.*keys' is not UTF-8 text \(byte 0\)"):
        ApiKeys(str(path))


def test_a_key_file_emptied_revokes_every_key(tmp_path, caplog):
    """An operator's answer to a leaked key file: empty it and SIGHUP. The reload took "lists no
    key" for a broken file and kept every key in force; only a restart revoked them."""
    path = tmp_path / "keys"
    path.write_text(KEYS)
    keys = ApiKeys(str(path))
    path.write_text("# revoked, every one\n")
    keys.reload()
    assert (keys.tenant("key-a"), keys.tenant("key-b")) == (None, None)
    assert keys.refusal((("authorization", "Bearer key-a"),)) == "unknown API key"
    assert "every call is refused" in caplog.text
    path.write_text("key-c gamma\n")
    keys.reload()
    assert keys.tenant("key-c") == "gamma"


def test_through_the_gateway_tenants_are_apart_and_its_hashes_are_the_workers(tiny_dirs, tmp_path):
    path = tmp_path / "keys"
    path.write_text(KEYS)
    for fleet in make_fleet(tiny_dirs["tiny"], 2, worker_config={"trust_tenant_metadata": True},
                            api_keys=str(path)):
        ids = [random.Random(2).randrange(3, 1024) for _ in range(40)]
        err = rpc_error(lambda: generate(fleet.stub, request(token_ids=ids, **greedy(2))))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        first, tokens = run(fleet.stub, ids, "key-a")
        gw = fleet.gateway.fleet
        alpha, beta = gw.hashes(ids, "alpha"), gw.hashes(ids, "beta")
        assert set(alpha).isdisjoint(beta)
        holder = next(w for w in fleet.workers if set(alpha) <= tree_hashes(w))   # the worker's own hashes
        assert not any(set(beta) & tree_hashes(w) for w in fleet.workers)
        wait_until(lambda: gw.index.matches(alpha, [holder.address])[holder.address] == len(alpha),
                   what="alpha's pages in the gateway's index")
        again, _ = run(fleet.stub, ids, "key-a2")
        assert first == 0 and again > 0   # routed to the worker that holds alpha's pages
        other, theirs = run(fleet.stub, ids, "key-b")
        assert other == 0 and theirs == tokens
        # Cancel goes to the worker with the tenant: its owner's key cancels, another's cannot
        call = fleet.stub.Generate(request(token_ids=[9] * 10, request_id="alpha-2", **greedy(1500)),
                                   metadata=bearer("key-a"), timeout=60)
        next(call)
        beta = list(fleet.stub.Generate(request(token_ids=[9] * 10, request_id="alpha-2", **greedy(3)),
                                        metadata=bearer("key-b"), timeout=60))   # its own id space
        assert beta[-1].finished.usage.completion_tokens == 3
        err = rpc_error(lambda: fleet.stub.Cancel(pb.CancelRequest(request_id="alpha-2"), metadata=bearer("key-b"),
                                                  timeout=10))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        fleet.stub.Cancel(pb.CancelRequest(request_id="alpha-2"), metadata=bearer("key-a"), timeout=10)
        assert list(call)[-1].finished.finish_reason == pb.FINISH_REASON_ABORT


def test_a_gateway_with_keys_routes_to_no_worker_that_would_share_its_cache_among_tenants(tiny_dirs, tmp_path,
                                                                                         caplog):
    """A worker without --trust-tenant-metadata drops the gateway's tenant: every tenant would
    hit every other's pages there (the gateway took it for a worker like any other)."""
    path = tmp_path / "keys"
    path.write_text(KEYS)
    worker = WorkerThreads(tiny_dirs["tiny"])
    gateway = None
    try:
        gateway = GatewayThread([worker.address], model=str(tiny_dirs["tiny"]), api_keys=str(path),
                                no_worker_timeout_s=1.0)
        gw = gateway.fleet
        wait_until(lambda: "does not take the gateway's tenants" in caplog.text, what="the refusal logged")
        wait_until(lambda: [w.state for w in gw.workers.values()] == ["not serving"], what="the worker left out")
        with grpc.insecure_channel(gateway.address) as ch:
            err = rpc_error(lambda: run(pb_grpc.InferenceStub(ch), [5] * 20, "key-a"))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()


def test_a_request_in_flight_survives_a_key_reload(keyed):
    """A key removed by SIGHUP stops new calls; one already streaming finishes."""
    server, path = keyed
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        call = stub.Generate(request(token_ids=[11] * 8, **greedy(300)), metadata=bearer("key-b"), timeout=60)
        next(call)
        path.write_text("key-a alpha\n")
        reload_now(server)
        try:
            assert list(call)[-1].finished.finish_reason == pb.FINISH_REASON_LENGTH
            err = rpc_error(lambda: list(stub.Generate(request(token_ids=[5], **greedy(2)), metadata=bearer("key-b"),
                                                       timeout=10)))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            path.write_text(KEYS)
            reload_now(server)   # before the test ends: its log line then has somewhere to go


def reload_now(server) -> None:
    """SIGHUP's reload, on the server's loop, waited for."""
    done = threading.Event()
    server.loop.call_soon_threadsafe(lambda: (server.servicer.keys.reload(), done.set()))
    assert done.wait(10)


def _catches(pid: int, signum: int) -> bool:
    """The process has a handler for the signal (SigCgt in /proc/PID/status)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def _command(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode().split("\0")
    except OSError:   # gone meanwhile
        return []


@pytest.mark.slow
@pytest.mark.parametrize("workers", [(), ("--workers", "2")], ids=["one model service", "a gateway and 2 workers"])
def test_sighup_to_kvserve_up_reloads_the_fronts_keys(tiny_dirs, tmp_path, workers):
    """A SIGHUP while the front still starts is kept and answered once it serves (its default
    action killed the child, and up started it again)."""
    import signal

    from tests.service.processes import children, free_port, kvserve, terminate, wait_serving

    path = tmp_path / "keys"
    path.write_text("old-key alpha\n")
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path / "up.log"
    with open(log, "wb") as err:
        proc = kvserve("up", "--model", str(tiny_dirs["tiny"]), "--listen", address, "--kvcache-listen",
                       f"unix://{tmp_path}/kv.sock", "--device", "cpu", "--page-size", "4", "--num-pages", "256",
                       "--api-keys", str(path), *workers, "--log-level", "warning", stderr=err)
    try:
        # up catches SIGHUP before it starts its children: with the front's process there, it still starts
        front = "gateway" if workers else "model"
        wait_until(lambda: _catches(proc.pid, signal.SIGHUP) and any(
            front in _command(pid) for pid in children(proc.pid)), what=f"up's {front} started", timeout=60)
        path.write_text("early-key alpha\n")
        proc.send_signal(signal.SIGHUP)
        wait_serving(address, proc)
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.InferenceStub(ch)

            def works(key: str) -> bool:
                try:
                    stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=bearer(key), timeout=10)
                    return True
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
                    return False

            wait_until(lambda: works("early-key"), what="the key of the early SIGHUP in force")
            path.write_text("new-key alpha\n")
            proc.send_signal(signal.SIGHUP)
            wait_until(lambda: works("new-key"), what="the new key in force")
            assert not works("early-key") and proc.poll() is None   # up passed it on and runs on
    finally:
        terminate(proc)
    assert "SIGHUP" not in log.read_text(), log.read_text()   # no child was killed by one


@pytest.mark.slow
def test_sighup_to_kvserve_up_without_keys_leaves_its_children_serving(tiny_dirs, tmp_path):
    """Nothing to re-read: up keeps the signal (passed on, it killed the model service and every
    stream on it, and up started it again)."""
    import signal

    from tests.service.processes import free_port, kvserve, terminate, wait_serving

    address = f"127.0.0.1:{free_port()}"
    log = tmp_path / "up.log"
    with open(log, "wb") as err:
        proc = kvserve("up", "--model", str(tiny_dirs["tiny"]), "--listen", address, "--kvcache-listen",
                       f"unix://{tmp_path}/kv.sock", "--device", "cpu", "--page-size", "4", "--num-pages", "256",
                       "--log-level", "info", stderr=err)
    try:
        wait_serving(address, proc)
        with grpc.insecure_channel(address) as ch:
            stream = pb_grpc.InferenceStub(ch).Generate(request(token_ids=[5, 6, 7], **greedy(200)),
                                                         timeout=60)
            first = next(stream)
            proc.send_signal(signal.SIGHUP)
            rest = list(stream)
        assert first.HasField("prefill_done") and rest[-1].finished.usage.completion_tokens == 200
        assert proc.poll() is None
    finally:
        terminate(proc)
    text = log.read_text()
    assert "SIGHUP ignored: there are no API keys to re-read" in text and "killed by SIGHUP" not in text, text


def test_a_sighup_while_a_keyed_server_starts_is_kept_and_answered_once_its_keys_are_watched(tmp_path):
    import asyncio
    import os
    import signal
    import time

    from kvserve.services.plumbing.api_keys import keep_sighup_until_watched

    path = tmp_path / "keys"
    path.write_text("old-key alpha\n")
    before = signal.getsignal(signal.SIGHUP)
    try:
        keep_sighup_until_watched()
        keys = ApiKeys(str(path))
        path.write_text("new-key alpha\n")
        os.kill(os.getpid(), signal.SIGHUP)   # its default action would end this process
        time.sleep(0.05)
        assert keys.tenant("old-key") == "alpha"

        async def watch():
            keys.watch()

        asyncio.run(watch())
        assert keys.tenant("new-key") == "alpha" and keys.tenant("old-key") is None
    finally:
        signal.signal(signal.SIGHUP, before)


def test_an_admin_token_that_metadata_cannot_carry_is_refused_when_read(tmp_path):
    from kvserve.services.plumbing.api_keys import read_token

    path = tmp_path / "token"
    path.write_text("s3cr\u00e9t\n")
    with pytest.raises(ValueError, match="holds characters other than printable ASCII"):
        read_token(str(path))
    path.write_bytes(b"s3\xffcret\n")
    with pytest.raises(ValueError, match=r"the admin token file '.*token' is not UTF-8 text \(byte 2\)"):
        read_token(str(path))   # (it was a traceback)
    path.write_text("  s3cret\n")
    assert read_token(str(path)) == "s3cret"
    path.write_text("\ufeffs3cret\n")   # a byte order mark, as some editors write, is not the token's
    assert read_token(str(path)) == "s3cret"
    path.write_bytes(b"\xef\xbb\xbfs3\xffcret\n")
    with pytest.raises(ValueError, match=r"is not UTF-8 text \(byte 5\)"):   # counted in the file, the mark's too
        read_token(str(path))


def test_a_key_file_that_opens_with_a_byte_order_mark_is_read(tmp_path):
    """Some editors open a UTF-8 file with one; it was taken for the first key's first character
    and the file refused ("a key must be printable ASCII")."""
    from kvserve.services.plumbing.api_keys import ApiKeys

    path = tmp_path / "keys"
    path.write_text("\ufeffkey-a alpha\nkey-b beta\n")
    keys = ApiKeys(str(path))
    assert (keys.tenant("key-a"), keys.tenant("key-b")) == ("alpha", "beta")


def test_a_caller_without_a_tenant_cannot_spell_a_tenants_request_id(tiny_dirs):
    """A worker that trusts its front's tenant knows alpha's "job-1" as "alpha\\0job-1", and a
    caller with no tenant (a second, keyless front) could Cancel it by that id: Generate refuses
    ids with control characters, Cancel did not look."""
    from tests.service.conftest import ModelServerThread
    from kvserve.services.plumbing.api_keys import TENANT_METADATA
    server = ModelServerThread(tiny_dirs["tiny"], listen="127.0.0.1:0", kvcache="inprocess", device="cpu",
                               page_size=4, num_pages=256, trust_tenant_metadata=True)
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            call = stub.Generate(request(token_ids=[9] * 10, request_id="job-1", **greedy(1000)),
                                 metadata=((TENANT_METADATA, "alpha"),), timeout=60)
            next(call)
            err = rpc_error(lambda: stub.Cancel(pb.CancelRequest(request_id="alpha\x00job-1"), timeout=10))
            assert err.code() == grpc.StatusCode.NOT_FOUND
            stub.Cancel(pb.CancelRequest(request_id="job-1"), metadata=((TENANT_METADATA, "alpha"),), timeout=10)
            events = list(call)
            assert events[-1].finished.finish_reason == pb.FINISH_REASON_ABORT
            assert events[-1].finished.usage.completion_tokens < 1000
    finally:
        server.stop()


def test_a_key_file_replaced_is_read_again_without_a_signal(tmp_path, monkeypatch):
    """On Kubernetes a Secret's update swaps a symlink under the mounted path and nothing sends
    SIGHUP: a leaked key that was revoked kept working until each pod was signalled."""
    from kvserve.services.plumbing import api_keys

    monkeypatch.setattr(api_keys, "FILE_POLL_S", 0.05)
    secret = tmp_path / "secret"
    first, second = tmp_path / "..2026_11_29_a", tmp_path / "..2026_11_29_b"
    for folder, text in ((first, "old-key alpha\n"), (second, "new-key alpha\n")):
        folder.mkdir()
        (folder / "keys").write_text(text)
    secret.mkdir()
    (secret / "..data").symlink_to(first)
    (secret / "keys").symlink_to(secret / "..data" / "keys")
    keys = ApiKeys(str(secret / "keys"))

    async def main():
        keys.watch()
        await asyncio.sleep(0.2)
        assert keys.tenant("old-key") == "alpha"   # nothing changed: nothing read again
        swap = secret / "..data_tmp"
        swap.symlink_to(second)
        os.replace(swap, secret / "..data")   # as the kubelet does it
        for _ in range(100):
            if keys.tenant("new-key"):
                break
            await asyncio.sleep(0.02)

    watched(main)
    assert keys.tenant("new-key") == "alpha" and keys.tenant("old-key") is None


def watched(main) -> None:
    """asyncio.run(main()), which watches keys (a SIGHUP handler on its loop): the process's own
    handler back after it."""
    async def run():
        try:
            await main()
        finally:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)

    before = signal.getsignal(signal.SIGHUP)
    try:
        asyncio.run(run())
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_file_found_emptied_by_a_look_revokes_the_keys_only_if_the_next_look_finds_it_so(tmp_path):
    """An editor truncates a file before it writes it: a look in between revoked every key for a
    while. A signal still takes an emptied file at once."""
    path = tmp_path / "keys"
    path.write_text("key-a alpha\n")
    keys = ApiKeys(str(path))

    async def main():
        keys.watch()
        keys.watch()   # (twice: one watch)
        path.write_text("")
        keys._look()
        assert keys.tenant("key-a") == "alpha"   # put off
        path.write_text("key-a alpha\nkey-b beta\n")   # the editor's write
        keys._look()
        assert keys.tenant("key-b") == "beta"
        path.write_text("# revoked\n")
        keys._look()
        keys._look()
        assert keys.tenant("key-a") is None   # empty on two looks: revoked

    watched(main)
