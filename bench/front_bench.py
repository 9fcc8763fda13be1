"""What the production front costs a request: TLS, mutual TLS, API keys, and the OpenAI-compatible
HTTP API against gRPC, each against plaintext gRPC on the same stack, in one run.

    .venv/bin/python bench/front_bench.py                 # the bench model, 3 rounds (~10 minutes)
    .venv/bin/python bench/front_bench.py --model tiny    # where the model costs least, the front shows most

For each mode a fresh `kvserve up` (the model service and its manager, real processes) serves the
same two workloads:
  - time to first token of one stream: `--sequential` requests one after another, a 64-token
    prompt, 1 token out (the whole call, as the client sees it), p50 and p90;
  - the front alone: `--sequential` GetModelInfo calls (HTTP: GET /v1/models), which the engine
    never sees, p50: what TLS, a key check or the HTTP translation add to a call, without the
    forward's noise;
  - throughput: `--streams` streams at once, each a 64-token prompt and `--new-tokens` greedy
    tokens (EOS ignored), streamed token by token; output tokens per second.
Every mode runs --rounds times, the modes interleaved, and the medians are compared. Modes:
plain gRPC; TLS; mutual TLS; API key (plaintext); TLS and API key; HTTP (/v1/completions,
streamed as server-sent events, plaintext). Certificates are made for the run (cryptography).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.throughput import free_port  # noqa: E402
from kvserve.inference.v1 import inference_pb2 as pb  # noqa: E402
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402
from kvserve.model_service.prompt_tokens import resolve_model_path  # noqa: E402
from kvserve.services.plumbing.tls import ClientTLS, aio_channel  # noqa: E402
from tests.security.certs import make_certs  # noqa: E402

CLI = [sys.executable, "-m", "kvserve.services.cli.main", "--log-level", "warning"]
KEY = "bench-key"


class Up:
    """`kvserve up` with the mode's flags; ready when its plaintext health port says SERVING."""

    def __init__(self, model: str, flags: list[str], http: bool) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.health = f"127.0.0.1:{free_port()}"
        self.http = f"127.0.0.1:{free_port()}" if http else ""
        extra = ["--http-listen", self.http] if http else []
        self.proc = subprocess.Popen(CLI + ["up", "--model", model, "--listen", self.address, "--kvcache-listen",
                                            f"unix://{tempfile.mkdtemp(prefix='kvserve-front-')}/kv.sock",
                                            "--device", "cpu", "--health-listen", self.health, *extra, *flags],
                                     cwd=ROOT)
        deadline = time.monotonic() + 600
        with grpc.insecure_channel(self.health) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvserve up exited with {self.proc.returncode}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("kvserve up did not become ready")
                time.sleep(0.3)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(n)]


def grpc_request(ids: list[int], new_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=new_tokens, ignore_eos=True))


class GrpcClient:
    def __init__(self, address: str, tls: ClientTLS | None, key: str) -> None:
        self.channel = aio_channel(address, tls)
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {key}"),) if key else ()

    async def run(self, ids: list[int], new_tokens: int) -> int:
        n = 0
        async for r in self.stub.Generate(grpc_request(ids, new_tokens), metadata=self.metadata, timeout=600):
            n += len(r.chunk.token_ids)
        return n

    async def info(self) -> None:
        await self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata, timeout=60)

    async def close(self) -> None:
        await self.channel.close()


class HttpClient:
    def __init__(self, address: str) -> None:
        self.client = httpx.AsyncClient(base_url=f"http://{address}", timeout=600,
                                        limits=httpx.Limits(max_connections=256))

    async def run(self, ids: list[int], new_tokens: int) -> int:
        body = {"prompt": ids, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        n = 0
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith('data: {"id"'):
                    usage = json.loads(line[6:]).get("usage")
                    n = usage["completion_tokens"] if usage else n
        return n

    async def info(self) -> None:
        (await self.client.get("/v1/models")).raise_for_status()

    async def close(self) -> None:
        await self.client.aclose()


async def measure(make_client, args, vocab: int) -> dict:
    client = make_client()   # its channel belongs to this run's loop
    for ids in prompts(5, vocab, 1):   # warm-up: connections, the first forward
        await client.run(ids, 1)
    first = []
    for ids in prompts(args.sequential, vocab, 2):
        start = time.perf_counter()
        await client.run(ids, 1)
        first.append(time.perf_counter() - start)
    first.sort()
    calls = []
    for _ in range(args.sequential):   # the front alone: a call the engine never sees
        start = time.perf_counter()
        await client.info()
        calls.append(time.perf_counter() - start)
    start = time.perf_counter()
    done = await asyncio.gather(*(client.run(ids, args.new_tokens) for ids in prompts(args.streams, vocab, 3)))
    wall = time.perf_counter() - start
    await client.close()
    return dict(p50=statistics.median(first), p90=first[int(0.9 * (len(first) - 1))], info=statistics.median(calls),
                tok_s=args.streams * args.new_tokens / wall, streamed=sum(done))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--sequential", type=int, default=200)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="every mode this many times, interleaved; medians")
    ap.add_argument("--modes", nargs="+", default=None, metavar="PREFIX",
                    help='only the modes whose name starts so, e.g. --modes "gRPC, plaintext" HTTP')
    args = ap.parse_args()
    model = str(resolve_model_path(args.model))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    folder = Path(tempfile.mkdtemp(prefix="kvserve-front-certs-"))
    certs = make_certs(folder)
    keys = folder / "keys"
    keys.write_text(f"{KEY} bench\n")
    server_tls = ["--tls-cert", certs.server.cert, "--tls-key", certs.server.key]
    modes = [("gRPC, plaintext", [], None, "", False),
             ("gRPC, TLS", server_tls, ClientTLS(ca=certs.ca), "", False),
             ("gRPC, mutual TLS", [*server_tls, "--tls-client-ca", certs.ca],
              ClientTLS(certs.ca, certs.client.cert, certs.client.key), "", False),
             ("gRPC, API key", ["--api-keys", str(keys)], None, KEY, False),
             ("gRPC, TLS + API key", [*server_tls, "--api-keys", str(keys)], ClientTLS(ca=certs.ca), KEY, False),
             ("HTTP, plaintext", [], None, "", True)]
    if args.modes:
        modes = [m for m in modes if any(m[0].startswith(prefix) for prefix in args.modes)]
    print(f"model {Path(model).name}; {args.sequential} sequential 64-token requests (1 token out); "
          f"{args.streams} streams x {args.new_tokens} tokens at once")
    runs: dict[str, list[dict]] = {name: [] for name, *_ in modes}
    for round_ in range(args.rounds):   # modes interleaved: a drift of the machine spreads over all
        for name, flags, tls, key, http in modes:
            up = Up(model, flags, http)
            try:
                make = (lambda: HttpClient(up.http)) if http else (lambda: GrpcClient(up.address, tls, key))
                r = asyncio.run(measure(make, args, vocab))
            finally:
                up.close()
            assert r["streamed"] == args.streams * args.new_tokens, (name, r["streamed"])
            runs[name].append(r)
            print(f"  round {round_ + 1}: {name:<22} p50 {r['p50'] * 1e3:7.2f} ms  model info {r['info'] * 1e3:6.2f} ms  "
                  f"{r['tok_s']:8.1f} tok/s", flush=True)
    median = {name: {k: statistics.median(r[k] for r in rs) for k in ("p50", "p90", "info", "tok_s")}
              for name, rs in runs.items()}
    base = median["gRPC, plaintext"]
    print(f"\nmedians of {args.rounds} rounds:")
    for name, r in median.items():
        print(f"  {name:<22} one request p50 {r['p50'] * 1e3:7.2f} ms (p90 {r['p90'] * 1e3:7.2f}; "
              f"{(r['p50'] - base['p50']) * 1e3:+.2f} ms)   model info p50 {r['info'] * 1e3:6.3f} ms "
              f"({(r['info'] - base['info']) * 1e3:+.3f})   {r['tok_s']:8.1f} tok/s ({r['tok_s'] / base['tok_s']:.3f}x)")


if __name__ == "__main__":
    main()
