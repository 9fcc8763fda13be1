"""`kvserve up --metrics-listen`: the manager's series and the model service's at one address;
with several workers, each worker's series carry its name."""

from __future__ import annotations

import json
import os
import platform
import random
import signal
import socket
import sys
import http.client
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter

from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.services.cli.stack_metrics import StackMetrics
from kvserve.services.plumbing.address import CannotListen
from kvserve.services.plumbing.metrics_server import add_process_series, serve_metrics
from tests.metrics.scrape import scrape, value
from tests.service.processes import children, free_port, kvserve, terminate, wait_serving
from tests.service.util import generate, greedy, request, wait_until


def test_children_series_are_served_together_with_their_worker_label():
    endpoints = []
    try:
        stack = StackMetrics()
        for name in ("worker-0", "worker-1"):
            registry = CollectorRegistry()
            Counter("kvserve:prompt_tokens", "x", registry=registry).inc(len(name) + int(name[-1]))
            add_process_series(registry)
            endpoints.append(serve_metrics("127.0.0.1:0", registry))
            stack.add(endpoints[-1].address, source=name, worker=name)
        stack.add(f"127.0.0.1:{free_port()}", worker="gone")   # a child restarting: left out, no error
        stack.count_restarts("worker-1", SimpleNamespace(restarts=2))
        # the gateway names workers by their private addresses (a temporary directory's): served
        # under the names the workers' own series carry, so that the two join
        registry = CollectorRegistry()
        Counter("kvserve:gateway_routed_requests", "x", ["worker"], registry=registry).labels(
            "unix:///tmp/kvserve-up-x/worker-1.sock").inc(3)
        endpoints.append(serve_metrics("127.0.0.1:0", registry))
        stack.add(endpoints[-1].address, workers={"unix:///tmp/kvserve-up-x/worker-1.sock": "worker-1"})
        registry = CollectorRegistry()
        registry.register(stack)
        endpoints.append(serve_metrics("127.0.0.1:0", registry))
        samples = scrape(endpoints[-1].address)
        # each child's process series under the same names, told apart by the child: no sample twice
        for name in ("worker-0", "worker-1"):
            assert value(samples, "process_resident_memory_bytes", source=name, worker=name) > 0
            assert value(samples, "python_info", source=name, worker=name, implementation="CPython",
                         major="3", minor=str(sys.version_info.minor), patchlevel=str(sys.version_info.micro),
                         version=platform.python_version()) == 1
        with urllib.request.urlopen(f"http://{endpoints[-1].address}/metrics", timeout=10) as response:
            lines = [line for line in response.read().decode().splitlines() if not line.startswith("#")]
        assert len(lines) == len(set(lines))
        assert value(samples, "kvserve:prompt_tokens_total", worker="worker-0") == 8
        assert value(samples, "kvserve:prompt_tokens_total", worker="worker-1") == 9
        assert value(samples, "kvserve:gateway_routed_requests_total", worker="worker-1") == 3
        assert not any(dict(labels).get("worker") == "gone" for _, labels in samples)
        # the child left out is said, and a restarted child's counters starting again from 0 too
        assert value(samples, "kvserve:stack_source_up", source="worker-0") == 1
        assert [v for (name, _), v in samples.items() if name == "kvserve:stack_source_up"].count(0) == 1
        assert value(samples, "kvserve:stack_child_restarts_total", child="worker-1") == 2
    finally:
        for e in endpoints:
            e.close()


PROMETHEUS_2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                       "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_the_series_are_at_metrics_only_and_addresses_that_cannot_serve_are_refused():
    registry = CollectorRegistry()
    Counter("kvserve:probe", "x", registry=registry).inc(3)
    endpoint = serve_metrics("127.0.0.1:0", registry)
    try:
        assert value(scrape(endpoint.address), "kvserve:probe_total") == 3
        for path in ("/", "/favicon.ico", "/metricsx", "/admin", "/metrics/../x"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(f"http://{endpoint.address}{path}", timeout=10)
            assert err.value.code == 404 and b"/metrics" in err.value.read(), path
        # HEAD has headers only (a body would be read as the next response on a kept-alive
        # connection); other methods are a 405
        conn = http.client.HTTPConnection(*endpoint.address.rsplit(":", 1), timeout=10)
        try:
            for path, status in (("/metrics", 200), ("/nope", 404)):
                conn.request("HEAD", path)
                reply = conn.getresponse()
                assert reply.status == status and reply.read() == b"", path
            conn.request("GET", "/metrics")   # the same connection still reads right
            assert conn.getresponse().read().count(b"kvserve:probe_total 3.0") == 1
            for method in ("POST", "DELETE"):
                conn.request(method, "/metrics")
                reply = conn.getresponse()
                assert reply.status == 405 and reply.getheader("Allow") == "GET, HEAD", method
                reply.read()
        finally:
            conn.close()
        with pytest.raises(CannotListen, match="cannot serve metrics on"):   # the port is taken: exit 3, no restart
            serve_metrics(endpoint.address, registry)
        # Prometheus 2 asks for OpenMetrics first; the text format comes back, its names as documented
        req = urllib.request.Request(f"http://{endpoint.address}/metrics", headers={"Accept": PROMETHEUS_2_ACCEPT})
        with urllib.request.urlopen(req, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain;")
            text = response.read().decode()
        assert "# TYPE kvserve:probe_total counter" in text or "# TYPE kvserve:probe counter" in text
        assert "kvserve:probe_total 3.0" in text and "kvserve_probe" not in text
    finally:
        endpoint.close()
    with pytest.raises(ValueError, match="must be host:port"):
        serve_metrics("unix:///tmp/metrics.sock", registry)


def test_idle_connections_neither_pile_up_threads_nor_keep_scrapes_out(monkeypatch, capfd):
    """A socket that sends nothing is closed after the idle timeout, and past MAX_CONNECTIONS
    a connection is closed at once: idle sockets held a thread each, for ever."""
    import socket
    import threading
    import time

    from kvserve.services.plumbing import metrics_server

    monkeypatch.setattr(metrics_server, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(metrics_server._Quiet, "timeout", 0.5)
    registry = CollectorRegistry()
    Counter("kvserve:probe", "x", registry=registry).inc()
    endpoint = serve_metrics("127.0.0.1:0", registry)
    host, port = endpoint.address.rsplit(":", 1)
    idle = []
    try:
        before = threading.active_count()
        idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(12)]
        time.sleep(0.2)
        assert threading.active_count() - before <= 4
        wait_until(lambda: threading.active_count() <= before, what="the idle connections closed")
        assert value(scrape(endpoint.address), "kvserve:probe_total") == 1   # a scrape still gets in
    finally:
        for s in idle:
            s.close()
        endpoint.close()
    # a timed-out connection is not an error (socketserver printed one, with a traceback, for each)
    assert "Exception occurred during processing of request" not in capfd.readouterr().err


@pytest.mark.slow
def test_up_serves_the_manager_and_the_model_service_at_one_address(tiny_dirs, tmp_path):
    """...and puts the HTTP front on its front service, whose clients' bad bytes write nothing
    to the log (uvicorn's WARNING for each, before any key is looked at, let any client fill it)."""
    address, metrics, http = (f"127.0.0.1:{free_port()}" for _ in range(3))
    log = open(tmp_path / "stderr", "w")
    proc = kvserve("up", "--model", str(tiny_dirs["tiny"]), "--listen", address, "--kvcache-listen",
                   f"127.0.0.1:{free_port()}", "--device", "cpu", "--page-size", "4", "--num-pages", "256",
                   "--metrics-listen", metrics, "--http-listen", http, "--log-level", "warning", stderr=log)
    log.close()
    try:
        wait_serving(address, proc)
        rng = random.Random(2)
        prompt = [rng.randrange(3, 1024) for _ in range(30)]
        with grpc.insecure_channel(address) as ch:
            for _ in range(2):
                generate(pb_grpc.InferenceStub(ch), request(token_ids=prompt, **greedy(5)))
        wait_until(lambda: value(scrape(metrics), "kvserve:kv_pages_used") == 0, what="the pages released")
        samples = scrape(metrics)
        assert value(samples, "kvserve:kv_pages_total") == 256
        assert abs(value(samples, "kvserve:kv_epoch_seconds") - time.time()) < 3600   # a registration time
        assert value(samples, "kvserve:kv_pages_cached") > 0
        assert value(samples, "kvserve:kv_step_seconds_count") > 0
        assert value(samples, "kvserve:kv_prefix_hit_tokens_total") > 0
        assert value(samples, "kvserve:prefix_cache_hits_total") == value(samples, "kvserve:kv_prefix_hit_tokens_total")
        assert value(samples, "kvserve:time_to_first_token_seconds_count") == 2
        assert value(samples, "kvserve:num_requests_running") == 0
        # each process's own memory and CPU, named as its log lines name it
        for source in ("worker", "worker/kvcache"):
            assert value(samples, "process_resident_memory_bytes", source=source) > 0
            assert value(samples, "process_cpu_seconds_total", source=source) > 0
        with urllib.request.urlopen(f"http://{http}/v1/models", timeout=10) as response:
            assert json.loads(response.read())["data"][0]["max_model_len"] > 0
        host, port = http.rsplit(":", 1)
        for junk in (b"\x16\x03\x01 not http\r\n\r\n",
                     b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"):
            for _ in range(3):
                with socket.create_connection((host, int(port)), timeout=10) as conn:
                    conn.sendall(junk)
                    conn.recv(4096)
        # a manager that hangs (stopped, not dead) costs its own series only: the model service's
        # stay, saying the manager does not answer (the model service waited on it as long as
        # the stack waited on the model service, and the scrape had nothing)
        [manager] = [pid for pid in children(proc.pid)
                     if b"kvcache" in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")]   # its subcommand
        os.kill(manager, signal.SIGSTOP)
        try:
            samples = scrape(metrics)
            assert value(samples, "kvserve:manager_reachable") == 0
            assert value(samples, "kvserve:num_requests_running") == 0
            assert value(samples, "kvserve:time_to_first_token_seconds_count") == 2
            assert not any(name.startswith("kvserve:kv_pages") for name, _ in samples)
        finally:
            os.kill(manager, signal.SIGCONT)
    finally:
        terminate(proc)
    said = (tmp_path / "stderr").read_text()
    assert "Invalid HTTP request" not in said and "upgrade" not in said.lower(), said
