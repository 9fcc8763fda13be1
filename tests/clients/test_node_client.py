"""The Node.js example client (clients/examples/node) against a live model service: the same
greedy tokens as the Python client, Cancel by request id, API keys and TLS.

Its npm packages are installed once per session into a temporary folder (never into the
repository); node finds them through NODE_PATH.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.security.certs import make_certs
from tests.service.conftest import ModelServerThread
from tests.service.util import generate, greedy, request, wait_until

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "clients" / "examples" / "node"
SCRIPT = EXAMPLE / "generate.js"

PROMPT_IDS = [1, 4, 78, 79, 6, 5]
MAX_TOKENS = 6
LONG = 1900          # tokens: far more than a cancelled request gets to generate
CANCEL_AFTER = 3
NPM_TIMEOUT_S = 300  # bounds for a hung subprocess, not performance expectations
NODE_TIMEOUT_S = 120

# npm's error codes when the registry cannot be reached (DNS, refused, reset, timed out, offline).
NETWORK_ERRORS = re.compile(r"\b(ENOTFOUND|EAI_AGAIN|ECONNREFUSED|ECONNRESET|ETIMEDOUT|ENETUNREACH|"
                            r"EHOSTUNREACH|ENOTCACHED|ERR_SOCKET_TIMEOUT|network)\b", re.IGNORECASE)

pytestmark = pytest.mark.slow  # npm install, and model services started for the module


@pytest.fixture(scope="session")
def node_modules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's packages, installed into a temporary folder; skips without node and npm."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip(f"the Node client needs node and npm on PATH (node: {node}, npm: {npm})")
    folder = tmp_path_factory.mktemp("node-client")
    shutil.copy(EXAMPLE / "package.json", folder)
    has_lock = (EXAMPLE / "package-lock.json").exists()
    if has_lock:
        shutil.copy(EXAMPLE / "package-lock.json", folder)
    # No install scripts: neither package needs one to work.
    cmd = [npm, "ci" if has_lock else "install", "--no-audit", "--no-fund", "--ignore-scripts"]
    try:
        done = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=NPM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"`{' '.join(cmd)}` did not finish in {NPM_TIMEOUT_S} s: is the npm registry reachable?")
    if done.returncode != 0:
        output = (done.stderr + done.stdout).strip()
        if NETWORK_ERRORS.search(output):
            first = " | ".join(output.splitlines()[:3])  # npm names the error code first
            pytest.skip(f"npm could not reach its registry: {first}")
        pytest.fail(f"`{' '.join(cmd)}` failed ({done.returncode}):\n{output}")
    return folder / "node_modules"


def run_node(node_modules: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NODE_PATH": str(node_modules)}
    return subprocess.run(["node", str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=NODE_TIMEOUT_S)


def events(stdout: str) -> list[dict]:
    """One JSON object per line, each naming its event: {"chunk": {...}}."""
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def tokens_of(evs: list[dict]) -> list[int]:
    return [t for e in evs if "chunk" in e for t in e["chunk"]["tokenIds"]]


def python_tokens(address: str, credentials: grpc.ChannelCredentials, metadata) -> list[int]:
    """What the Python client gets over TLS for the greedy request the Node client makes."""
    with grpc.secure_channel(address, credentials) as channel:
        stub = pb_grpc.InferenceStub(channel)
        msg = request(token_ids=PROMPT_IDS, **greedy(MAX_TOKENS))
        return [t for e in stub.Generate(msg, metadata=metadata, timeout=60) if e.HasField("chunk")
                for t in e.chunk.token_ids]


GREEDY_ARGS = ("--token-ids", ",".join(map(str, PROMPT_IDS)), "--max-tokens", str(MAX_TOKENS),
               "--temperature", "0", "--ignore-eos")


def test_greedy_stream_matches_the_python_client(node_modules, model_server) -> None:
    done = run_node(node_modules, model_server.address, *GREEDY_ARGS)
    assert done.returncode == 0, done.stderr
    evs = events(done.stdout)
    assert list(evs[0]) == ["prefillDone"] and list(evs[-1]) == ["finished"], evs
    assert all(list(e) == ["chunk"] for e in evs[1:-1]), evs
    assert evs[0]["prefillDone"]["promptTokens"] == len(PROMPT_IDS)
    finished = evs[-1]["finished"]
    assert finished["finishReason"] == "FINISH_REASON_LENGTH"
    assert finished["usage"]["completionTokens"] == MAX_TOKENS

    with grpc.insecure_channel(model_server.address) as channel:
        expected = generate(pb_grpc.InferenceStub(channel), request(token_ids=PROMPT_IDS, **greedy(MAX_TOKENS)))
    assert tokens_of(evs) == expected.tokens
    assert "".join(e["chunk"]["text"] for e in evs[1:-1]) == expected.text


def test_a_prompt_in_text(node_modules, model_server) -> None:
    done = run_node(node_modules, model_server.address, "The cache page", "--max-tokens", "4",
                    "--temperature", "0", "--ignore-eos")
    assert done.returncode == 0, done.stderr
    evs = events(done.stdout)
    assert evs[-1]["finished"]["usage"]["completionTokens"] == 4 == len(tokens_of(evs))


def test_cancel_after_n_tokens_aborts_the_request(node_modules, model_server) -> None:
    engine = model_server.servicer.engine
    done = run_node(node_modules, model_server.address, "--token-ids", ",".join(map(str, PROMPT_IDS)),
                    "--max-tokens", str(LONG), "--temperature", "0", "--ignore-eos",
                    "--cancel-after", str(CANCEL_AFTER))
    assert done.returncode == 0, done.stderr
    evs = events(done.stdout)
    request_id = evs[0]["prefillDone"]["requestId"]
    assert request_id.startswith("node-")   # the id the client set, and cancelled by
    assert f"cancelling {request_id}" in done.stderr
    assert "Cancel failed" not in done.stderr, done.stderr
    finished = evs[-1]["finished"]
    assert finished["finishReason"] == "FINISH_REASON_ABORT"
    assert CANCEL_AFTER <= finished["usage"]["completionTokens"] == len(tokens_of(evs)) < LONG
    wait_until(lambda: engine.num_live() == 0, timeout=30, what="the engine to drop the cancelled request")


def test_a_bad_request_exits_with_the_status(node_modules, model_server) -> None:
    done = run_node(node_modules, model_server.address, "--token-ids", "1,4", "--temperature=-1")
    assert done.returncode == 1
    assert done.stdout == ""
    assert "INVALID_ARGUMENT: temperature" in done.stderr, done.stderr


def test_api_key_and_tls(node_modules, tiny_dirs, tmp_path) -> None:
    certs = make_certs(tmp_path / "certs")
    keys = tmp_path / "keys"
    keys.write_text("node-key tenant-a\n")
    server = ModelServerThread(tiny_dirs["tiny"], tls_cert=certs.server.cert, tls_key=certs.server.key,
                               api_keys=str(keys))
    try:
        creds = grpc.ssl_channel_credentials(Path(certs.ca).read_bytes())
        expected = python_tokens(server.address, creds, metadata=(("authorization", "Bearer node-key"),))
        assert len(expected) == MAX_TOKENS

        done = run_node(node_modules, server.address, *GREEDY_ARGS, "--tls-ca", certs.ca, "--api-key", "node-key")
        assert done.returncode == 0, done.stderr
        assert tokens_of(events(done.stdout)) == expected

        unknown = run_node(node_modules, server.address, *GREEDY_ARGS, "--tls-ca", certs.ca, "--api-key", "nope")
        assert unknown.returncode == 1 and "UNAUTHENTICATED" in unknown.stderr, unknown.stderr
        missing = run_node(node_modules, server.address, *GREEDY_ARGS, "--tls-ca", certs.ca)
        assert missing.returncode == 1 and "UNAUTHENTICATED" in missing.stderr, missing.stderr
    finally:
        server.stop()
