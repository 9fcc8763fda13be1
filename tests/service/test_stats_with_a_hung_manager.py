"""A model service whose manager hangs (a stopped process, a partition: no error, no answer)
still reports its stats within a client's deadline, the manager marked unreachable: `kvserve
top` polls with a 5 s deadline, and the report waited out --manager-timeout."""

from __future__ import annotations

import threading
import time

import grpc

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.gateway.conftest import WorkerThreads


def test_a_hung_manager_leaves_the_report_prompt_and_says_so(tiny_dirs):
    worker = WorkerThreads(tiny_dirs["tiny"], manager_timeout_s=10.0)
    release = threading.Event()
    try:
        with grpc.insecure_channel(worker.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            assert stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10).manager_reachable
            manager = worker.manager.manager
            stats = manager.stats
            manager.stats = lambda: (release.wait(30), stats())[1]   # its event loop holds, as a stopped process's
            start = time.monotonic()
            report = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=20)
            assert time.monotonic() - start < 15   # its 1 s look at the manager, not the manager's 30 s hang
            assert not report.manager_reachable and not report.HasField("kvcache")
    finally:
        release.set()
        worker.stop()
