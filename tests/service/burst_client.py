"""A hostile client, run as its own process: `python -m tests.service.burst_client ADDRESS N SEED
SECONDS` sends N prompts of 10,000 to 800,000 characters at once, and sends each again as soon as
it is answered until SECONDS have passed (a refusal is fast: a single wave would be over before
ordinary requests could arrive during it). It prints one line per phase: "sending", then "done"
with the status code of each call as JSON. It runs at the lowest CPU
priority, as a client on another machine would take none of the server's cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time

import grpc

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc

WORDS = "the model token cache page batch memory server stream café naïve 日本語 東京 request prompt 🙂".split()


def text(size: int, rng: random.Random) -> str:
    words = []
    total = 0
    while total < size:
        word = rng.choice(WORDS)
        words.append(word)
        total += len(word) + 1
    return " ".join(words)[:size]


async def send(stub, prompt: str) -> str:
    try:
        async for _ in stub.Generate(pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=4)),
                                     timeout=60):
            pass
        return "OK"
    except grpc.aio.AioRpcError as exc:
        return exc.code().name


async def main(address: str, count: int, seed: int, seconds: float) -> None:
    rng = random.Random(seed)
    prompts = [text(rng.randrange(10_000, 800_001), rng) for _ in range(count)]
    codes: list[str] = []
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.InferenceStub(ch)
        stop_at = time.monotonic() + seconds

        async def lane(prompt: str) -> None:
            codes.append(await send(stub, prompt))
            while time.monotonic() < stop_at:
                codes.append(await send(stub, prompt))

        print("sending", time.time(), flush=True)
        await asyncio.gather(*(lane(p) for p in prompts))
    print("done", time.time(), json.dumps(codes), flush=True)


if __name__ == "__main__":
    os.nice(19)
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
