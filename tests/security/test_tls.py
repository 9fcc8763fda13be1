"""TLS on the model service, the manager and the gateway, and mutual TLS where both ends are
kvserve's: a client that does not trust the server's CA, or has no certificate when one is
required, gets nothing; one that does gets the same tokens as over plaintext."""

from __future__ import annotations

import os
import random
import shutil
import socket
import time
from pathlib import Path

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.kvcache.v1 import kvcache_pb2 as kv_pb
from kvserve.kvcache.v1 import kvcache_pb2_grpc as kv_pb_grpc
from kvserve.kvcache_service.config import KVCacheServerConfig
from kvserve.kvcache_service.core import ManagerConfig
from kvserve.model_service.lane_server import LaneServer
from kvserve.services.plumbing.tls import ClientTLS, ServerTLS, channel
from tests.gateway.conftest import GatewayThread, WorkerThreads
from tests.security.certs import make_certs
from tests.kvcache.conftest import ServerThread
from tests.service.conftest import ModelServerThread
from tests.service.util import generate, greedy, request, rpc_error

PROMPT = [random.Random(6).randrange(3, 1024) for _ in range(20)]


def tokens(address: str, tls: ClientTLS | None) -> list[int]:
    with channel(address, tls) as ch:
        return generate(pb_grpc.InferenceStub(ch), request(token_ids=PROMPT, **greedy(8)), timeout=30).tokens


def refused(address: str, tls: ClientTLS | None) -> grpc.RpcError:
    with channel(address, tls) as ch:
        return rpc_error(lambda: generate(pb_grpc.InferenceStub(ch), request(token_ids=PROMPT, **greedy(2)),
                                          timeout=5))


@pytest.fixture(scope="module")
def plain(tiny_dirs):
    server = ModelServerThread(tiny_dirs["tiny"])
    try:
        yield tokens(server.address, None)
    finally:
        server.stop()


def test_the_model_service_over_tls(tiny_dirs, certs, plain):
    server = ModelServerThread(tiny_dirs["tiny"], tls_cert=certs.server.cert, tls_key=certs.server.key)
    try:
        assert tokens(server.address, ClientTLS(ca=certs.ca)) == plain
        assert refused(server.address, None).code() == grpc.StatusCode.UNAVAILABLE            # plaintext
        assert refused(server.address, ClientTLS(ca=certs.other_ca)).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_mutual_tls_wants_a_client_certificate_the_ca_signed(tiny_dirs, certs, plain):
    server = ModelServerThread(tiny_dirs["tiny"], tls_cert=certs.server.cert, tls_key=certs.server.key,
                               tls_client_ca=certs.ca)
    try:
        assert tokens(server.address, ClientTLS(certs.ca, certs.client.cert, certs.client.key)) == plain
        assert refused(server.address, ClientTLS(ca=certs.ca)).code() == grpc.StatusCode.UNAVAILABLE
        stranger = ClientTLS(certs.ca, certs.stranger.cert, certs.stranger.key)
        assert refused(server.address, stranger).code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_the_model_service_reaches_its_manager_over_mutual_tls(tiny_dirs, certs, plain):
    manager = ServerThread("127.0.0.1:0", ManagerConfig(num_pages=512, page_size=4, max_seqs=64),
                           KVCacheServerConfig(tls_cert=certs.server.cert, tls_key=certs.server.key,
                                               tls_client_ca=certs.ca))
    try:
        with channel(manager.address, None) as ch:   # plaintext is refused
            err = rpc_error(lambda: kv_pb_grpc.KVCacheManagerStub(ch).GetStats(kv_pb.GetStatsRequest(), timeout=5))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        server = ModelServerThread(tiny_dirs["tiny"], kvcache=manager.address, kvcache_tls_ca=certs.ca,
                                   kvcache_tls_cert=certs.client.cert, kvcache_tls_key=certs.client.key)
        try:
            assert tokens(server.address, None) == plain
        finally:
            server.stop()
    finally:
        manager.stop()


@pytest.fixture
def mtls_worker(tiny_dirs, certs):
    """A worker (its own manager) that takes only clients with a certificate the CA signed."""
    worker = WorkerThreads(tiny_dirs["tiny"], tls_cert=certs.server.cert, tls_key=certs.server.key,
                           tls_client_ca=certs.ca)
    try:
        yield worker
    finally:
        worker.stop()


def test_the_gateway_serves_tls_and_reaches_its_workers_over_mutual_tls(tiny_dirs, certs, plain, mtls_worker):
    gateway = GatewayThread([mtls_worker.address], model=str(tiny_dirs["tiny"]), tls_cert=certs.server.cert,
                            tls_key=certs.server.key, worker_tls_ca=certs.ca, worker_tls_cert=certs.client.cert,
                            worker_tls_key=certs.client.key)
    try:
        gateway.wait_serving(1)
        assert tokens(gateway.address, ClientTLS(ca=certs.ca)) == plain
        assert refused(gateway.address, None).code() == grpc.StatusCode.UNAVAILABLE
        lane = gateway.fleet.workers[mtls_worker.address].lane   # its lane, over the same mutual TLS
        assert lane is not None and lane.calls == 1 and lane.fallbacks == 0
    finally:
        gateway.stop()


def test_a_gateway_without_the_workers_ca_never_sees_them_serving(tiny_dirs, mtls_worker):
    gateway = GatewayThread([mtls_worker.address], model=str(tiny_dirs["tiny"]), no_worker_timeout_s=1.0)
    try:
        err = refused(gateway.address, None)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "no worker has been serving" in err.details()
    finally:
        gateway.stop()


@pytest.mark.parametrize("kwargs, message", [
    (dict(cert="x.pem", key=""), "give both --tls-cert and --tls-key"),
    (dict(cert="", key="", client_ca="ca.pem"), "--tls-client-ca needs --tls-cert and --tls-key"),
    (dict(cert="/nonexistent/cert.pem", key="/nonexistent/key.pem"), "cannot read TLS"),
])
def test_half_a_configuration_fails_with_a_sentence(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerTLS.of(**kwargs).credentials()   # half a pair when made; a missing file when read


def test_a_file_that_is_not_pem_is_named(tmp_path):
    bad = tmp_path / "cert.pem"
    bad.write_text("hello")
    with pytest.raises(ValueError, match="is not PEM"):
        ServerTLS.of(str(bad), str(bad)).credentials()


def test_a_key_not_the_certificates_and_a_ca_with_no_certificate_are_named(certs):
    """gRPC's own answer would be "cannot listen" on a server and a failed handshake in a client."""
    with pytest.raises(ValueError, match=r"the TLS key '.*client.key' is not the key of the certificate "
                                         r"'.*server.pem'"):
        ServerTLS.of(certs.server.cert, certs.client.key).credentials()
    with pytest.raises(ValueError, match=r"do not load as a certificate and its key: are they swapped\?"):
        ServerTLS.of(certs.server.key, certs.server.cert).credentials()
    with pytest.raises(ValueError, match=r"client CA '.*server.key' holds no certificate"):
        ServerTLS.of(certs.server.cert, certs.server.key, certs.server.key).credentials()
    with pytest.raises(ValueError, match="is not the key of the certificate"):
        ClientTLS.of(certs.ca, certs.client.cert, certs.server.key).credentials()
    with pytest.raises(ValueError, match=r"CA certificate '.*client.key' holds no certificate"):
        ClientTLS.of(certs.client.key).credentials()
    ServerTLS.of(certs.server.cert, certs.server.key, certs.ca).credentials()   # a right one still loads
    ClientTLS.of(certs.ca, certs.client.cert, certs.client.key).credentials()


def test_probes_reach_health_in_plaintext_on_a_port_of_its_own(tiny_dirs, certs):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from tests.service.processes import free_port

    health = f"127.0.0.1:{free_port()}"
    server = ModelServerThread(tiny_dirs["tiny"], tls_cert=certs.server.cert, tls_key=certs.server.key,
                               health_listen=health)
    try:
        with grpc.insecure_channel(health) as ch:
            for service in ("", "liveness", "kvserve.inference.v1.Inference"):
                answer = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
            assert refused(health, None).code() == grpc.StatusCode.UNIMPLEMENTED   # health, nothing else
    finally:
        server.stop()
    with grpc.insecure_channel(health) as ch:   # stopped with the server
        err = rpc_error(lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_the_gateway_checks_workers_certificates_against_their_service_name(certs):
    from kvserve.services.gateway.config import GatewayConfig

    found = GatewayConfig(workers_dns="kvserve-workers:50051", worker_tls_ca=certs.ca)
    assert found.worker_tls().server_name == "kvserve-workers"   # the pods' own addresses are in no certificate
    named = GatewayConfig(worker=("10.0.0.7:50051",), worker_tls_ca=certs.ca, worker_tls_server_name="w.example")
    assert named.worker_tls().server_name == "w.example" and named.worker_tls().options() == [
        ("grpc.ssl_target_name_override", "w.example")]
    assert GatewayConfig(workers_dns="kvserve-workers:50051").worker_tls() is None   # plaintext stays plaintext
    # a server name alone asks for TLS, on the system's roots (it stayed plaintext without a word)
    alone = GatewayConfig(worker=("10.0.0.7:50051",), worker_tls_server_name="w.example").worker_tls()
    assert alone is not None and alone.ca == "" and alone.server_name == "w.example"
    from kvserve.model_service.config import ModelServiceConfig
    kv = ModelServiceConfig(kvcache="10.0.0.8:50061", kvcache_tls_server_name="m.example").kvcache_tls()
    assert kv is not None and kv.server_name == "m.example"


def test_a_lane_over_tls_takes_no_client_without_the_cas_certificate(tiny_dirs, certs, mtls_worker):
    """The lane serves TLS as the worker's gRPC port does: a client certificate the CA did not
    sign gets no call through (the gateway's lane then falls back to gRPC, refused there too)."""
    from kvserve.services.plumbing import lane_wire
    import asyncio
    import ssl

    host, port = mtls_worker.model.servicer.lane.address.rsplit(":", 1)

    async def handshake(tls: ClientTLS) -> bool:
        try:
            reader, writer = await asyncio.open_connection(host, int(port), ssl=tls.ssl_context(),
                                                           server_hostname=host)
        except (ssl.SSLError, OSError):
            return False
        writer.write(lane_wire.MAGIC + lane_wire.frame(lane_wire.CALL, b""))
        try:
            data = await asyncio.wait_for(reader.read(5), 5)
        except (ssl.SSLError, OSError):
            return False
        finally:
            writer.close()
        return bool(data)   # a status frame came back: the worker read the call

    assert asyncio.run(handshake(ClientTLS(ca=certs.ca, cert=certs.client.cert, key=certs.client.key)))
    assert not asyncio.run(handshake(ClientTLS(ca=certs.ca, cert=certs.stranger.cert, key=certs.stranger.key)))
    assert not asyncio.run(handshake(ClientTLS(ca=certs.ca)))


def _swap_in(certs, live: Path) -> None:
    """The server's certificate, key and client CA replaced as the kubelet replaces a Secret's
    files: each one whole (a file renamed over the last)."""
    for src, name in ((certs.server.cert, "tls.crt"), (certs.server.key, "tls.key"), (certs.ca, "ca.crt")):
        tmp = live / f".{name}.new"
        shutil.copyfile(src, tmp)
        os.replace(tmp, live / name)


def test_a_renewed_certificate_and_client_ca_are_served_without_a_restart(tmp_path, monkeypatch):
    """Certificates were read once: when cert-manager renewed a Secret, servers kept the old one
    until it expired and every connection failed. gRPC and the lane's and HTTP's contexts read
    the files again once they change: the new certificate is served, and a client certificate of
    the retired CA is refused; files that do not load leave the ones in use whole."""
    import asyncio
    import ssl

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from kvserve.services.plumbing import tls as tls_module
    from tests.server_thread import LoopThread

    monkeypatch.setattr(tls_module, "RELOOK_S", 0.0)
    monkeypatch.setattr(tls_module, "CONTEXT_RELOOK_S", 0.05)
    old, new = make_certs(tmp_path / "old"), make_certs(tmp_path / "new")
    live = tmp_path / "live"
    live.mkdir()
    _swap_in(old, live)
    served = ServerTLS(str(live / "tls.crt"), str(live / "tls.key"), str(live / "ca.crt"))
    loop = LoopThread("tls-rotation")

    async def answer(_reader, writer):
        writer.write(b"k")
        await writer.drain()
        writer.close()

    async def start():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", served.credentials())
        await server.start()
        context = served.ssl_context()
        stop = served.keep_current(context)
        listener = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=context)
        lane = LaneServer(servicer=None, tls=served, max_request_bytes=1 << 16)   # its own context, kept so
        await lane.start("127.0.0.1:0")
        return server, port, listener, stop, lane

    def grpc_ok(certs) -> bool:
        with channel(f"localhost:{port}", ClientTLS(certs.ca, certs.client.cert, certs.client.key)) as ch:
            try:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                return True
            except grpc.RpcError:
                return False

    def context_ok(certs) -> bool:
        client = ssl.create_default_context(cafile=certs.ca)
        client.load_cert_chain(certs.client.cert, certs.client.key)
        try:
            with socket.create_connection(("127.0.0.1", listener.sockets[0].getsockname()[1]), timeout=5) as raw:
                with client.wrap_socket(raw, server_hostname="localhost") as tls:
                    return tls.recv(1) == b"k"   # (TLS 1.3 refuses a client's certificate after the handshake)
        except (ssl.SSLError, OSError):
            return False

    def lane_serves(certs) -> bool:
        """The lane's certificate is the one `certs`' CA signed (a handshake, no client certificate asked of it)."""
        client = ssl.create_default_context(cafile=certs.ca)
        client.load_cert_chain(certs.client.cert, certs.client.key)
        host, port = lane.address.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=5) as raw:
                with client.wrap_socket(raw, server_hostname="localhost"):
                    return True
        except (ssl.SSLError, OSError):
            return False

    server, port, listener, stop, lane = loop.call(start())
    try:
        assert grpc_ok(old) and not grpc_ok(new) and context_ok(old) and not context_ok(new)
        (live / "tls.key").write_text("-----BEGIN nothing\n")   # half written: the ones in use stay
        time.sleep(0.2)
        assert grpc_ok(old) and context_ok(old)
        _swap_in(new, live)
        time.sleep(0.2)
        assert grpc_ok(new) and not grpc_ok(old)
        assert context_ok(new) and not context_ok(old)   # the retired CA's client is refused too
        assert lane_serves(new) and not lane_serves(old)
    finally:
        async def stop_all():
            stop()
            listener.close()
            await lane.close()
            await server.stop(None)
        loop.call(stop_all())
        loop.close()
