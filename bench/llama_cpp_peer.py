"""llama.cpp's server as a peer in the throughput bench: the same prompts (as token ids), sent
at once, greedy, EOS ignored, to `llama-server` with one slot per request (its continuous
batching), on every core of this machine.

llama.cpp is not a dependency: pass the path of a `llama-server` binary built on this machine and
a GGUF of the same weights (its convert_hf_to_gguf.py); bench/README.md says how they were made.
Its own defaults otherwise (KV cache in f16, its batch sizes).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    def __init__(self, binary: str, gguf: Path, slots: int, slot_context: int, threads: int | None = None) -> None:
        threads = threads or os.cpu_count() or 1
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-np", str(slots),
             "-c", str(slots * slot_context), "-t", str(threads), "-tb", str(threads), "--no-webui"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"llama-server ({binary}) did not come up")
            time.sleep(0.2)

    def complete(self, prompt: list[int], new_tokens: int) -> int:
        """Greedy, EOS ignored: -> tokens generated."""
        body = json.dumps({"prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "ignore_eos": True,
                           "cache_prompt": False}).encode()
        req = urllib.request.Request(f"{self.url}/completion", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())["tokens_predicted"]

    def stream(self, prompt: list[int], new_tokens: int) -> list[float]:
        """Greedy, EOS ignored, streamed (server-sent events, a message per token): when each
        token arrived (perf_counter), as a gRPC client of kvserve sees its stream."""
        body = json.dumps({"prompt": prompt, "n_predict": new_tokens, "temperature": 0.0, "ignore_eos": True,
                           "cache_prompt": False, "stream": True}).encode()
        req = urllib.request.Request(f"{self.url}/completion", data=body, headers={"Content-Type": "application/json"})
        times: list[float] = []
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if line.startswith(b"data: "):
                    message = json.loads(line[6:])
                    if not message.get("stop"):
                        times += [time.perf_counter()] * len(message.get("tokens") or [0])
        return times

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_llama_server(binary: str, gguf: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    """Every prompt at once: -> output tok/s over the wall time, and the tokens generated."""
    server = LlamaServer(binary, gguf, len(prompts), max(map(len, prompts)) + new_tokens + 16)
    try:
        server.complete(list(range(3, 40)), 4)   # warm-up
        with ThreadPoolExecutor(len(prompts)) as pool:
            start = time.perf_counter()
            tokens = sum(pool.map(lambda p: server.complete(p, new_tokens), prompts))
            wall = time.perf_counter() - start
    finally:
        server.close()
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall}
