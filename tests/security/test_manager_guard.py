"""The manager's write RPCs answer only its own pod (a Unix socket, loopback) or the admin token;
its read-only ones answer anyone."""

from __future__ import annotations

import socket

import grpc
import pytest

from kvserve.kvcache.v1 import kvcache_pb2 as kv_pb
from kvserve.kvcache.v1 import kvcache_pb2_grpc as kv_pb_grpc
from kvserve.kvcache_service.config import KVCacheServerConfig
from kvserve.kvcache_service.core import ManagerConfig
from kvserve.services.plumbing.auth import is_local_peer
from tests.kvcache.conftest import ServerThread
from tests.service.util import rpc_error


@pytest.mark.parametrize("peer, local", [
    ("unix:/tmp/kv.sock", True), ("unix:", True), ("ipv4:127.0.0.1:5555", True), ("ipv4:127.8.9.1:1", True),
    ("ipv6:[::1]:5555", True), ("ipv4:10.0.0.7:5555", False), ("ipv6:[fd00::2]:5555", False),
    ("ipv4:128.0.0.1:1", False), ("", False),
    # as grpc writes them: the brackets escaped
    ("ipv6:%5B::1%5D:5555", True), ("ipv6:%5B::ffff:127.0.0.1%5D:5555", True), ("ipv6:%5Bfd00::2%5D:5555", False),
    ("ipv6:%5B::ffff:10.0.0.7%5D:1", False), ("ipv6:%5Bnot-an-address%5D:1", False)])
def test_local_peers(peer, local):
    assert is_local_peer(peer) is local


def test_the_pods_own_caller_over_ipv6_loopback_is_local():
    """A manager on [::1] took its own model service for an outsider: grpc escapes the brackets."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        manager = ServerThread("[::1]:0", ManagerConfig(num_pages=16, page_size=4, max_seqs=8), KVCacheServerConfig())
    except Exception as exc:   # a kernel without IPv6 loopback
        pytest.skip(f"cannot listen on [::1]: {exc}")
    try:
        with grpc.insecure_channel(manager.address) as ch:
            reply = kv_pb_grpc.KVCacheManagerStub(ch).Register(kv_pb.RegisterRequest(epoch=7, page_size=4,
                                                                                     num_pages=16), timeout=10)
        assert reply.reset
    finally:
        manager.stop()


def outside_address() -> str | None:
    """This machine's address on its network (not loopback), if it has one."""
    for target in ("10.255.255.255", "192.0.2.1", "198.51.100.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((target, 9))   # no packet is sent; this only picks the route's source address
            except OSError:
                continue
            ip = s.getsockname()[0]
        if not ip.startswith("127.") and ip != "0.0.0.0":
            return ip
    return None


def test_write_rpcs_from_beyond_the_pod_need_the_admin_token(tmp_path):
    ip = outside_address()
    if ip is None:
        pytest.skip("this machine has no address but loopback to call from")
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    manager = ServerThread("0.0.0.0:0", ManagerConfig(num_pages=16, page_size=4, max_seqs=8),
                           KVCacheServerConfig(admin_token_file=str(token)))
    try:
        port = manager.address.rsplit(":", 1)[1]
        register = kv_pb.RegisterRequest(epoch=7, page_size=4, num_pages=16)
        with grpc.insecure_channel(f"{ip}:{port}") as ch:
            stub = kv_pb_grpc.KVCacheManagerStub(ch)
            assert stub.GetStats(kv_pb.GetStatsRequest(), timeout=10).total_pages == 16   # read-only: open
            err = rpc_error(lambda: stub.Register(register, timeout=10))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "admin token" in err.details()
            err = rpc_error(lambda: stub.Register(register, metadata=(("authorization", "Bearer wrong"),),
                                                  timeout=10))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            stream = stub.StepStream(iter([kv_pb.StepRequest(epoch=7)]), timeout=10)
            assert rpc_error(lambda: list(stream)).code() == grpc.StatusCode.PERMISSION_DENIED
            for what in (lambda: list(stub.WatchEvents(kv_pb.WatchEventsRequest(snapshot=True), timeout=10)),
                         lambda: stub.MatchPrefix(kv_pb.MatchPrefixRequest(token_ids=[1, 2, 3, 4]), timeout=10)):
                assert rpc_error(what).code() == grpc.StatusCode.PERMISSION_DENIED   # they show what it holds
            stub.Register(register, metadata=(("authorization", "Bearer s3cret"),), timeout=10)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:   # from the pod itself: no token needed
            kv_pb_grpc.KVCacheManagerStub(ch).Register(kv_pb.RegisterRequest(epoch=8, page_size=4, num_pages=16),
                                                       timeout=10)
        assert manager.manager.stats().epoch == 8
    finally:
        manager.stop()


def test_a_unix_socket_is_closed_to_other_users_whatever_the_umask(tmp_path):
    """A Unix socket counts as private (only the pod reaches it); under a umask of 0 a server's
    socket was open to every user of the host."""
    import os
    import stat

    from kvserve.model_service.lane_server import LaneServer
    from tests.server_thread import LoopThread

    before = os.umask(0)
    try:
        manager = ServerThread(f"unix://{tmp_path}/kv.sock", ManagerConfig(num_pages=16, page_size=4, max_seqs=8),
                               KVCacheServerConfig())
        lane, loop = LaneServer(servicer=None, tls=None, max_request_bytes=1 << 20), LoopThread("lane")
        loop.call(lane.start(f"unix://{tmp_path}/lane.sock"))
    finally:
        os.umask(before)
    try:
        for name in ("kv.sock", "lane.sock"):
            mode = stat.S_IMODE(os.stat(tmp_path / name).st_mode)
            assert mode & 0o007 == 0 and mode & 0o600 == 0o600, (name, oct(mode))
    finally:
        loop.call(lane.close())
        loop.close()
        manager.stop()
