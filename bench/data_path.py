#!/usr/bin/env python
"""The data path from Generate to streamed tokens, as calls between kvserve's files.

    .venv/bin/python bench/data_path.py            # the hops, in the order first made
    .venv/bin/python bench/data_path.py --summary  # the counts only

Starts a KV-cache manager and a model service (the tiny model, CPU) in this process, on real
sockets, warms them up with one request and waits until both are idle, then records every
call from a function in one of kvserve's files into a function in another while a second
greedy request goes from the client's Generate call until the engine has handed its first two
tokens to the front end's event loop (the relay's flush after the step that sampled the second:
the prefill's token, then one decode step's), and the manager has answered every Step sent
until then (the engine sends the next step's before its forward). A hop is one
distinct (caller, callee) pair; a call made once per layer or per token counts once; a
property read is data, not a hop, and is left out. docs/architecture.md lists the hops it
printed right after the restructuring that shortened them, and counts today's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENS = 2   # the prefill's token and one decode step's
PACKAGE_DIRS = tuple(str(ROOT / d) + os.sep for d in ("services", "kvcache_service", "model_service", "clients"))


class HopRecorder:
    """A profile function for every thread: records cross-file calls between kvserve's files."""

    def __init__(self) -> None:
        self.on = False
        self.tokens_sent = 0
        self.flushed = False            # the engine handed the token over: its part of the path ends
        self.steps_sent = self.steps_answered = 0
        self.hops: dict[tuple[str, str], str] = {}   # (caller, callee) -> the thread that made it first

    def __call__(self, frame, event, arg):
        if not self.on or event != "call":
            return
        name = frame.f_code.co_qualname
        if name == "RemoteKVClient.send_step" and not self.flushed:
            self.steps_sent += 1
        elif name == "step_plan_to_pb":
            self.steps_answered += 1
        elif name == "Engine._send_tokens":
            self.tokens_sent += 1
        elif name == "EventRelay.flush" and self.tokens_sent == TOKENS:
            self.flushed = True
        if self.flushed and name != "EventRelay.flush":
            in_a_step_sent_before = self.steps_answered < self.steps_sent or (
                name == "step_plan_to_pb" and self.steps_answered == self.steps_sent)
            if threading.current_thread().name != "manager" or not in_a_step_sent_before:
                return
        callee = frame.f_code.co_filename
        if not callee.startswith(PACKAGE_DIRS):
            return
        # The nearest kvserve frame up the stack is the caller: torch's nn.Module.__call__ or a
        # decorator in between does not hide a hop.
        caller_frame, depth = frame.f_back, 0
        while caller_frame is not None and depth < 8 and not caller_frame.f_code.co_filename.startswith(PACKAGE_DIRS):
            caller_frame, depth = caller_frame.f_back, depth + 1
        if caller_frame is None or not caller_frame.f_code.co_filename.startswith(PACKAGE_DIRS):
            return
        caller = caller_frame.f_code.co_filename
        if caller == callee or _is_property(frame):
            return
        key = (_name(caller, caller_frame.f_code), _name(callee, frame.f_code))
        self.hops.setdefault(key, threading.current_thread().name)


def _is_property(frame) -> bool:
    owner = frame.f_locals.get("self")
    return owner is not None and isinstance(getattr(type(owner), frame.f_code.co_name, None), property)


def _name(path: str, code) -> str:
    return f"{os.path.relpath(path, ROOT)}:{code.co_qualname}"


def serve(model: Path, socket: str):
    """A manager and a model service on their own loop threads; the model service's address."""
    from kvserve.kvcache_service.server import create_server as create_manager
    from kvserve.model_service.config import ModelServiceConfig
    from kvserve.model_service.server import create_server as create_model_service

    def run(coro, name: str):
        """On a loop of its own: the model service registers with the manager synchronously."""
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name=name, daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, loop).result(300)

    config = ModelServiceConfig(model=str(model), listen="127.0.0.1:0", kvcache=socket, device="cpu",
                                page_size=16, num_pages=256)
    manager, _ = run(create_manager(socket, config.manager_config(256, 16)), "manager")
    model_service, _ = run(create_model_service(config), "model service")
    return model_service.address, (manager, model_service)   # kept: a dropped server stops


def generate(address: str, prompt: list[int]) -> None:
    """A greedy request of 4 tokens, streamed to its end; then both services are idle."""
    import time

    import grpc

    from kvserve.inference.v1 import inference_pb2 as pb
    from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        request = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        request.token_ids.ids.extend(prompt)
        for _ in stub.Generate(request, timeout=60):
            pass
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:   # its pages released, in the engine's next step
            stats = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
            if stats.running == stats.waiting == stats.kvcache.num_sequences == 0:
                return
            time.sleep(0.05)
        raise TimeoutError("the model service did not go idle")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--summary", action="store_true", help="print the counts only")
    args = ap.parse_args()

    from kvserve.model_service.tiny_model import default_tiny_path

    recorder = HopRecorder()
    threading.setprofile(recorder)   # every thread started from here on: the servers', the engine's
    sys.setprofile(recorder)
    with tempfile.TemporaryDirectory() as tmp:
        address, _servers = serve(default_tiny_path("tiny"), f"unix://{tmp}/kv.sock")
        generate(address, list(range(5, 40)))          # warm-up: what happens once per process
        recorder.on = True
        generate(address, list(range(50, 83)))
    sys.setprofile(None)
    threading.setprofile(None)

    hops = recorder.hops
    files = Counter((caller.split(":")[0], callee.split(":")[0]) for caller, callee in hops)
    print(f"{len(hops)} hops (distinct caller -> callee pairs across files), "
          f"{len(files)} distinct file -> file pairs, from Generate to the first {TOKENS} streamed tokens")
    if args.summary:
        return
    for (caller, callee), thread in hops.items():
        print(f"  [{thread}] {caller} -> {callee}")
    os._exit(0)   # the servers' threads need no orderly shutdown here


if __name__ == "__main__":
    main()
