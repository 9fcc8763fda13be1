"""The kvcache bench's backends: the core in-process, the same through protobuf without a
transport, and `kvserve kvcache` in its own process over gRPC."""

from __future__ import annotations

import cProfile
import os
import signal
import socket
import subprocess
import sys
import time

from bench.kvcache_trace import EPOCH, PS, StepDesc

# ----------------------------------------------------------------------------- backends

class CoreBackend:
    """The core, called in-process with core StepRequest objects."""
    name = "in-process core"

    def __init__(self, num_pages: int, max_seqs: int) -> None:
        from kvserve.kvcache_service.core import KVCacheManager, ManagerConfig
        from kvserve.kvcache_service.contract import types as t
        self.t = t
        self.m = KVCacheManager(ManagerConfig(num_pages=num_pages, page_size=PS, max_seqs=max_seqs))
        self.m.register(EPOCH, PS, num_pages)
        self.profiler: cProfile.Profile | None = None

    def build(self, d: StepDesc):
        t = self.t
        return t.StepRequest(
            epoch=EPOCH, releases=d.releases,
            commits=[t.Commit(s, n, toks) for s, n, toks in d.commits],
            needs=[t.Grow(s, n) for s, n in d.grows] + [t.Admit(r, p, "", mt) for r, p, mt in d.admits])

    def step(self, req):
        clock, cpu = time.perf_counter_ns, time.thread_time_ns
        if self.profiler is None:
            c0 = cpu()
            t0 = clock()
            plan = self.m.step(req)
            t1 = clock()
            c1 = cpu()
        else:
            c0 = cpu()
            t0 = clock()
            self.profiler.enable()
            plan = self.m.step(req)
            self.profiler.disable()
            t1 = clock()
            c1 = cpu()
        return plan.results, plan.preempted, t1 - t0, c1 - c0, ()

    def stats(self) -> dict:
        s = self.m.stats()
        return {f: getattr(s, f) for f in type(s).__slots__}

    def close(self) -> None:
        pass


def build_pb(pb, d: StepDesc):
    """A pb.StepRequest built directly, the way the model service's client should: sub-messages
    are filled in place (repeated.add(), field sets). Faster than build_pb_simple (--profile
    prints both), which constructs every Need/Grow/Commit and hands lists of them to the
    constructor, so upb copies each one again."""
    req = pb.StepRequest(epoch=EPOCH, releases=d.releases)
    add = req.commits.add
    for s, n, toks in d.commits:
        add(seq_id=s, num_computed=n, token_ids=toks)
    add = req.needs.add
    for s, n in d.grows:
        g = add().grow
        g.seq_id = s
        g.num_tokens = n
    for r, p, mt in d.admits:
        a = add().admit
        a.request_id = r
        a.token_ids.extend(p)
        if mt is not None:
            a.max_tokens = mt
    return req


def build_pb_simple(pb, d: StepDesc):
    """The obvious way to build the same message (for the comparison in --profile)."""
    needs = [pb.Need(grow=pb.Grow(seq_id=s, num_tokens=n)) for s, n in d.grows]
    for r, p, mt in d.admits:
        if mt is None:
            needs.append(pb.Need(admit=pb.Admit(request_id=r, token_ids=p)))
        else:
            needs.append(pb.Need(admit=pb.Admit(request_id=r, token_ids=p, max_tokens=mt)))
    return pb.StepRequest(
        epoch=EPOCH, releases=d.releases,
        commits=[pb.Commit(seq_id=s, num_computed=n, token_ids=toks) for s, n, toks in d.commits],
        needs=needs)


class PbInProcBackend(CoreBackend):
    """What the server does per Step, minus gRPC and the transport: the client builds
    a pb.StepRequest, it is serialized and parsed, convert.step_request_from_pb, the core
    step, convert.step_plan_to_pb, the response serialized and parsed."""
    name = "in-process via protobuf"

    def __init__(self, num_pages: int, max_seqs: int) -> None:
        super().__init__(num_pages, max_seqs)
        from kvserve.kvcache_service.contract import convert
        from kvserve.kvcache.v1 import kvcache_pb2 as pb
        self.pb, self.convert = pb, convert
        self.profilers: dict[str, cProfile.Profile] | None = None

    def build(self, d: StepDesc):
        if self.profilers:
            prof = self.profilers
            prof["client build (simple)"].enable()
            simple = build_pb_simple(self.pb, d)
            prof["client build (simple)"].disable()
            prof["client build"].enable()
            msg = build_pb(self.pb, d)
            prof["client build"].disable()
            assert msg == simple
            return msg
        return build_pb(self.pb, d)

    def step(self, msg):
        pb, convert, m, clock = self.pb, self.convert, self.m, time.perf_counter_ns
        prof = self.profilers or {}
        c0 = time.thread_time_ns()
        t0 = clock()
        wire = msg.SerializeToString()
        req_pb = pb.StepRequest.FromString(wire)
        t1 = clock()
        if prof:
            prof["server convert"].enable()
        req = convert.step_request_from_pb(req_pb)
        if prof:
            prof["server convert"].disable()
        t2 = clock()
        if prof:
            prof["core step"].enable()
        plan = m.step(req)
        if prof:
            prof["core step"].disable()
        t3 = clock()
        if prof:
            prof["server convert"].enable()
        resp = convert.step_plan_to_pb(plan)
        if prof:
            prof["server convert"].disable()
        t4 = clock()
        out = resp.SerializeToString()
        resp2 = pb.StepResponse.FromString(out)
        t5 = clock()
        c1 = time.thread_time_ns()
        # extra: (wire in, decode, core, encode, wire out, request bytes, response bytes)
        return resp2.results, resp2.preempted, t5 - t0, c1 - c0, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4,
                                                          len(wire), len(out))


def free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class GrpcBackend:
    """`kvserve kvcache` in its own process (python -m kvserve.services.cli.main kvcache ...), a sync grpc
    channel in this one: client and server do not share a GIL."""

    def __init__(self, name: str, listen: str, num_pages: int, max_seqs: int, server_profile: str | None,
                 stream: bool = False) -> None:
        import grpc
        from kvserve.kvcache.v1 import kvcache_pb2 as pb
        from kvserve.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
        self.name, self.pb = name, pb
        cmd = [sys.executable]
        if server_profile:  # cProfile writes the stats when the server exits (SIGTERM: a graceful stop)
            cmd += ["-m", "cProfile", "-o", server_profile]
        cmd += ["-m", "kvserve.services.cli.main", "--log-level", "warning", "kvcache", "--listen", listen,
                "--num-pages", str(num_pages), "--max-seqs", str(max_seqs), "--page-size", str(PS)]
        self.proc = subprocess.Popen(cmd)
        opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        self.channel = grpc.insecure_channel(listen, options=opts)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=60)
        except grpc.FutureTimeoutError:
            self.close()
            raise RuntimeError(f"kvserve kvcache did not come up on {listen}") from None
        self.stub = pb_grpc.KVCacheManagerStub(self.channel)
        self.stub.Register(pb.RegisterRequest(epoch=EPOCH, page_size=PS, num_pages=num_pages, instance="bench"))
        if stream:  # what the engine uses: one long-lived StepStream
            from kvserve.kvcache_service.contract.client import _StepStream
            self._stream = _StepStream(self.stub)
            self._step = self._stream_step
        else:
            self._stream = None
            self._step = self.stub.Step

    def _stream_step(self, msg):
        self._stream.send(msg)
        return self._stream.receive()

    def build(self, d: StepDesc):
        return build_pb(self.pb, d)

    def step(self, msg):
        t0 = time.perf_counter_ns()
        resp = self._step(msg)
        t1 = time.perf_counter_ns()
        return resp.results, resp.preempted, t1 - t0, 0, ()

    def empty_rtt(self, n: int) -> list[int]:
        msg, step, out = self.pb.StepRequest(epoch=EPOCH), self._step, []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            step(msg)
            out.append(time.perf_counter_ns() - t0)
        return out

    def stats(self) -> dict:
        s = self.stub.GetStats(self.pb.GetStatsRequest())
        return {f.name: getattr(s, f.name) for f in s.DESCRIPTOR.fields}

    def server_cpu_s(self) -> float:
        """CPU seconds the server process has used, all threads (user + system)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
