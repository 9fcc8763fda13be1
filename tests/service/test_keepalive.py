"""A peer that freezes (SIGSTOP: the process stops, its sockets stay open, as a hung host's or a
network path gone without a reset) ends its calls on the other side within seconds, on both
sides: kvserve's servers ping a quiet client and drop it, and the SDK's client pings a quiet
server and raises UNAVAILABLE with a sentence. gRPC core waits `grpc.http2.ping_timeout_ms`
(60 s by default) for a ping's answer whatever `grpc.keepalive_timeout_ms` says, so without
their own setting of it both sides held such a call for a minute and more."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvserve.clients.inference_client import InferenceClient, KVServeError
from tests.service.processes import REPO

NOTICED_WITHIN_S = 30   # a ping after 1 s of quiet, then kvserve's 10 s for its answer; gRPC's default: 61 s

def peer(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.service.frozen_peer", *args], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)

def line_within(proc: subprocess.Popen, seconds: float) -> str | None:
    """The next line `proc` prints, or None when none comes within `seconds`."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(seconds)
    return got[0].strip() if got else None

def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()   # SIGKILL ends a stopped process too
        p.wait(10)

@pytest.mark.slow
def test_a_frozen_client_is_dropped_by_the_server():
    # the keepalive's quiet time shortened from 30 s; the answer's wait is the server's default
    server = peer("server", json.dumps({"grpc.keepalive_time_ms": 1000}))
    client = None
    try:
        port = line_within(server, 30)
        assert port and port.isdigit(), port
        client = peer("client", f"127.0.0.1:{port}")
        assert line_within(client, 30) == "streaming"
        os.kill(client.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        assert line_within(server, NOTICED_WITHIN_S + 5) == "call ended", "the server still holds the call"
        assert time.monotonic() - frozen_at < NOTICED_WITHIN_S
    finally:
        stop(*[p for p in (client, server) if p is not None])

@pytest.mark.slow
def test_a_frozen_server_ends_the_sdk_call_unavailable_with_a_sentence(quiet_s=4):
    """Quiet first (which a server frozen at once needs no more than): gRPC stopped pinging after
    two pings without data, and a stream quiet for a while (queued, a long prefill) found its
    frozen server only a minute later."""
    # the server accepts the client's shortened pings; the answer's wait is the SDK's default
    server = peer("server", json.dumps({"grpc.http2.min_ping_interval_without_data_ms": 100}))
    try:
        port = line_within(server, 30)
        assert port and port.isdigit(), port
        with InferenceClient(f"127.0.0.1:{port}", timeout=120,
                             options=[("grpc.keepalive_time_ms", 1000)]) as client:
            events = client.generate("a")
            next(events)
            time.sleep(quiet_s)   # pinged each second, no data either way
            os.kill(server.pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            with pytest.raises(KVServeError) as err:
                next(events)
        assert time.monotonic() - frozen_at < NOTICED_WITHIN_S
        assert err.value.code == "UNAVAILABLE"
        assert "stopped answering" in err.value.message, err.value.message
    finally:
        stop(server)

def test_options_given_to_the_sdk_win_over_its_keepalive_defaults():
    from kvserve.clients.connection import KEEPALIVE_OPTIONS, channel_options
    assert channel_options(()) == list(KEEPALIVE_OPTIONS)
    mine = channel_options([("grpc.keepalive_time_ms", 5), ("grpc.primary_user_agent", "me")])
    assert dict(mine)["grpc.keepalive_time_ms"] == 5
    assert dict(mine)["grpc.http2.ping_timeout_ms"] == dict(KEEPALIVE_OPTIONS)["grpc.http2.ping_timeout_ms"]
    assert sum(name == "grpc.keepalive_time_ms" for name, _ in mine) == 1
