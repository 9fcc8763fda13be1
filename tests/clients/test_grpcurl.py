"""grpcurl against a live model service, through server reflection only (no .proto files):
what clients/examples/grpcurl.md shows works as written there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.service.util import generate, greedy, request

PROMPT_IDS = [1, 4, 78, 79, 6, 5]
MAX_TOKENS = 6
GRPCURL_TIMEOUT_S = 60  # a bound for a hung grpcurl, not a performance expectation


def _find_grpcurl() -> str:
    """The grpcurl binary on PATH or next to this interpreter (the virtualenv's bin/)."""
    candidates = [shutil.which("grpcurl"), str(Path(sys.executable).parent / "grpcurl")]
    found = next((c for c in candidates if c and os.access(c, os.X_OK)), None)
    if found is None:
        pytest.skip("grpcurl is not on PATH nor next to the Python interpreter")
    try:
        probe = subprocess.run([found, "-version"], capture_output=True, text=True, timeout=GRPCURL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"{found} cannot be run: {exc}")
    if probe.returncode != 0:
        pytest.skip(f"`{found} -version` failed ({probe.returncode}): {(probe.stderr or probe.stdout).strip()}")
    return found


@pytest.fixture(scope="module")
def grpcurl_bin() -> str:
    return _find_grpcurl()


def grpcurl(binary: str, address: str, *args: str, data: dict | None = None) -> subprocess.CompletedProcess:
    """`grpcurl -plaintext [-d JSON] ADDRESS ARGS...`, without any .proto file."""
    cmd = [binary, "-plaintext", "-connect-timeout", "10"]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    return subprocess.run([*cmd, address, *args], capture_output=True, text=True, timeout=GRPCURL_TIMEOUT_S)


def json_objects(text: str) -> list[dict]:
    """The JSON objects grpcurl prints one after another (each pretty-printed over several lines)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return out
        obj, i = decoder.raw_decode(text, i)
        out.append(obj)


def test_list_shows_the_services(grpcurl_bin, model_server) -> None:
    done = grpcurl(grpcurl_bin, model_server.address, "list")
    assert done.returncode == 0, done.stderr
    services = done.stdout.split()
    assert "kvserve.inference.v1.Inference" in services
    assert "grpc.health.v1.Health" in services


def test_describe_shows_generate(grpcurl_bin, model_server) -> None:
    done = grpcurl(grpcurl_bin, model_server.address, "describe", "kvserve.inference.v1.Inference")
    assert done.returncode == 0, done.stderr
    assert "rpc Generate" in done.stdout
    assert "stream .kvserve.inference.v1.GenerateResponse" in done.stdout


def test_greedy_generate_matches_the_python_client(grpcurl_bin, model_server) -> None:
    data = {"tokenIds": {"ids": PROMPT_IDS},
            "sampling": {"temperature": 0, "maxTokens": MAX_TOKENS, "ignoreEos": True}}
    done = grpcurl(grpcurl_bin, model_server.address, "kvserve.inference.v1.Inference/Generate", data=data)
    assert done.returncode == 0, done.stderr
    events = json_objects(done.stdout)
    # grpcurl prints proto field names and leaves out fields at their zero value.
    assert list(events[0]) == ["prefill_done"] and list(events[-1]) == ["finished"], events
    assert all(list(e) == ["chunk"] for e in events[1:-1]), events
    tokens = [t for e in events[1:-1] for t in e["chunk"]["token_ids"]]
    finished = events[-1]["finished"]
    assert finished["finish_reason"] == "FINISH_REASON_LENGTH"
    assert finished["usage"]["completion_tokens"] == MAX_TOKENS
    assert finished["usage"]["prompt_tokens"] == len(PROMPT_IDS)

    with grpc.insecure_channel(model_server.address) as channel:
        expected = generate(pb_grpc.InferenceStub(channel), request(token_ids=PROMPT_IDS, **greedy(MAX_TOKENS)))
    assert len(expected.tokens) == MAX_TOKENS
    assert tokens == expected.tokens


def test_bad_request_reports_invalid_argument(grpcurl_bin, model_server) -> None:
    data = {"tokenIds": {"ids": PROMPT_IDS}, "sampling": {"temperature": -1, "maxTokens": MAX_TOKENS}}
    done = grpcurl(grpcurl_bin, model_server.address, "kvserve.inference.v1.Inference/Generate", data=data)
    assert done.returncode != 0
    assert "Code: InvalidArgument" in done.stderr, done.stderr
    assert "temperature" in done.stderr
