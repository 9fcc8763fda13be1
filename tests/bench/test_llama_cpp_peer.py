"""bench/llama_cpp_peer.py against a stand-in for llama-server (the real one is not a dependency):
the flags it is started with, the requests it is sent, and the rate computed from the replies."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.llama_cpp_peer import run_llama_server

FAKE = '''#!{python}
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
log = open({log!r}, "a")
log.write(json.dumps({{"argv": args}}) + "\\n"); log.flush()

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        log.write(json.dumps({{"body": body}}) + "\\n"); log.flush()
        reply = json.dumps({{"tokens_predicted": body["n_predict"]}}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(reply))); self.end_headers()
        self.wfile.write(reply)

ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def test_every_prompt_goes_to_one_slot_each_greedy_and_eos_ignored(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    binary = tmp_path / "llama-server"
    binary.write_text(FAKE.format(python=sys.executable, log=str(log)))
    binary.chmod(0o755)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    result = run_llama_server(str(binary), tmp_path / "model.gguf", prompts, 16)
    assert result["tokens"] == 3 * 16 and result["tok_s"] > 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    argv = lines[0]["argv"]
    assert argv[argv.index("-np") + 1] == "3" and argv[argv.index("-c") + 1] == str(3 * (4 + 16 + 16))
    bodies = [line["body"] for line in lines[1:]]
    assert bodies[0]["n_predict"] == 4   # the warm-up
    assert sorted(b["prompt"] for b in bodies[1:]) == sorted(prompts)
    assert all(b["temperature"] == 0 and b["ignore_eos"] and not b["cache_prompt"] for b in bodies)
