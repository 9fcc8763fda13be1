#!/usr/bin/env python
"""What one more process in a request's path costs on this machine, below any gateway logic:
the floor under bench/gateway_bench.py's "gateway adds".

    .venv/bin/python bench/hop_floor.py                  # 400 calls of each, in turn
    .venv/bin/python bench/hop_floor.py --calls 1000
    .venv/bin/python bench/hop_floor.py --h2             # also bench/h2_relay.py (pip install h2)

Three measurements, each in one run on the same cores:
  - a thread wake-up: two threads passing a token back and forth through eventfds, both on one
    CPU and on two (the cost every hand-off between a gRPC poller thread, the asyncio loop and
    the engine pays);
  - an empty Inference.Generate call (two empty messages back) to a grpc.aio server that does
    nothing else, called directly, through bench/bare_relay.py (the same grpc.aio hop the
    gateway makes, nothing more), and through a relay that copies the TCP bytes both ways on
    one asyncio loop without reading them (no HTTP/2, no gRPC: what the hop costs when nothing
    is parsed); with --h2, also through bench/h2_relay.py (HTTP/2 on the h2 library, each
    request message parsed: a relay that speaks gRPC's framing without grpcio). Calls go to
    each in turn; the figures are p50s and the medians of the paired differences from the
    direct call;
  - the CPU time each server process spends per call (/proc), over a run of calls to it alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.throughput import cpu_seconds, free_port  # noqa: E402
from kvserve.inference.v1 import inference_pb2 as pb  # noqa: E402
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402


# ------------------------------------------------------------------------ thread wake-ups

def wakeup_round_trip(cpu_a: int, cpu_b: int, n: int = 5000) -> float:
    """Seconds for one thread to wake another and be woken back (eventfds), each pinned."""
    ping, pong = os.eventfd(0), os.eventfd(0)

    def other() -> None:
        os.sched_setaffinity(0, {cpu_b})   # 0: the calling thread, on Linux
        for _ in range(n):
            os.eventfd_read(ping)
            os.eventfd_write(pong, 1)

    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu_a})
    thread = threading.Thread(target=other)
    thread.start()
    try:
        start = time.perf_counter()
        for _ in range(n):
            os.eventfd_write(ping, 1)
            os.eventfd_read(pong)
        return (time.perf_counter() - start) / n
    finally:
        thread.join()
        os.sched_setaffinity(0, before)
        os.close(ping)
        os.close(pong)


# ------------------------------------------------------------------------- the servers

class Empty(pb_grpc.InferenceServicer):
    async def Generate(self, request, context):
        yield pb.GenerateResponse()
        yield pb.GenerateResponse()


async def serve_empty(listen: str) -> None:
    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(Empty(), server)
    server.add_insecure_port(listen)
    await server.start()
    await server.wait_for_termination()


async def serve_tcp_relay(listen: str, upstream: str) -> None:
    """Each connection spliced to a new one upstream; the bytes copied as they come."""
    up_host, up_port = upstream.rsplit(":", 1)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def splice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(up_host, int(up_port))
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    host, port = listen.rsplit(":", 1)
    server = await asyncio.start_server(splice, host, int(port))
    await server.serve_forever()


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT)


def wait_ready(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=60)


# -------------------------------------------------------------------------------- calls

def call(stub) -> float:
    start = time.perf_counter()
    for _ in stub.Generate(pb.GenerateRequest(), timeout=10):
        pass
    return time.perf_counter() - start


def in_turn(addresses: dict[str, str], n: int) -> dict[str, list[float]]:
    """n calls to each target, their order rotating each round; 50 warm-up rounds first."""
    names = list(addresses)
    stubs = {name: pb_grpc.InferenceStub(grpc.insecure_channel(a)) for name, a in addresses.items()}
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(n + 50):
        for name in names[i % len(names):] + names[:i % len(names)]:
            t = call(stubs[name])
            if i >= 50:
                times[name].append(t)
    return times


def cpu_per_call(address: str, pids: dict[str, int], n: int) -> dict[str, float]:
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(address))
    for _ in range(50):
        call(stub)
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    for _ in range(n):
        call(stub)
    return {name: (cpu_seconds(pid) - before[name]) / n for name, pid in pids.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--h2", action="store_true", help="also relay through bench/h2_relay.py (needs the h2 package)")
    ap.add_argument("--serve-empty", metavar="LISTEN", help=argparse.SUPPRESS)
    ap.add_argument("--serve-tcp-relay", nargs=2, metavar=("LISTEN", "UPSTREAM"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_empty:
        return asyncio.run(serve_empty(args.serve_empty))
    if args.serve_tcp_relay:
        return asyncio.run(serve_tcp_relay(*args.serve_tcp_relay))

    cpus = sorted(os.sched_getaffinity(0))
    print(f"{os.cpu_count()} CPUs; grpcio {grpc.__version__}")
    same = statistics.median(wakeup_round_trip(cpus[0], cpus[0]) for _ in range(3))
    line = f"thread wake-up round trip: one CPU {same * 1e6:.1f} us"
    if len(cpus) > 1:
        cross = statistics.median(wakeup_round_trip(cpus[0], cpus[1]) for _ in range(3))
        line += f", two CPUs {cross * 1e6:.1f} us"
    print(line)

    direct, relay, tcp, h2 = (f"127.0.0.1:{free_port()}" for _ in range(4))
    targets = {"direct": (direct, ["server"]), "grpc.aio relay": (relay, ["server", "grpc.aio relay"]),
               "tcp relay": (tcp, ["server", "tcp relay"])}
    procs = {"server": start(__file__, "--serve-empty", direct)}
    try:
        wait_ready(direct)
        procs["grpc.aio relay"] = start(str(ROOT / "bench" / "bare_relay.py"), relay, direct)
        procs["tcp relay"] = start(__file__, "--serve-tcp-relay", tcp, direct)
        if args.h2:
            procs["h2 relay"] = start(str(ROOT / "bench" / "h2_relay.py"), h2, direct)
            targets["h2 relay"] = (h2, ["server", "h2 relay"])
        for address, _ in targets.values():
            wait_ready(address)
        times = in_turn({name: address for name, (address, _) in targets.items()}, args.calls)
        print(f"\nan empty Generate call, {args.calls} to each in turn:")
        for name, xs in times.items():
            paired = statistics.median(b - a for a, b in zip(times["direct"], xs))
            print(f"  {name:<15} p50 {statistics.median(xs) * 1e3:6.3f} ms"
                  + (f"   adds {paired * 1e3:+.3f} ms" if name != "direct" else ""))
        print("\nCPU per call (ms), each target called alone:")
        for name, (address, pids) in targets.items():
            per = cpu_per_call(address, {p: procs[p].pid for p in pids}, args.calls)
            print(f"  {name:<15} " + ", ".join(f"{p} {v * 1e3:.3f}" for p, v in per.items()))
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(30)


if __name__ == "__main__":
    main()
