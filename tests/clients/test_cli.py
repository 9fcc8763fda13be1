"""`kvserve generate` and `kvserve chat` as real subprocesses against the test model service."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve.clients.inference_client import InferenceClient

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60
GENERATE_SUMMARY = re.compile(
    r"\[(\d+) prompt tokens \((\d+) cached\), (\d+) completion tokens, ttft [\d.]+ ms, total [\d.]+ ms, "
    r"[\d.]+ tokens/s, finish (\w+)")
TURN_SUMMARY = re.compile(r"\[turn (\d+): (\d+) prompt tokens, (\d+) from cache, (\d+) generated, ttft [\d.]+ ms")


def kvserve(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvserve.services.cli.main", *args], input=stdin, capture_output=True,
                          text=True, encoding="utf-8", errors="replace", cwd=REPO, timeout=TIMEOUT_S)


def test_generate_streams_text_and_a_summary(model_server, client: InferenceClient) -> None:
    prompt = "The cache page holds the key and value vectors"
    expected = client.complete(prompt, max_tokens=20, temperature=0, ignore_eos=True)
    r = kvserve("generate", prompt, "--address", model_server.address, "--max-tokens", "20",
                "--temperature", "0", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == expected.text.replace("\r\n", "\n").rstrip("\n")
    m = GENERATE_SUMMARY.search(r.stderr)
    assert m, r.stderr
    assert (int(m[1]), int(m[3]), m[4]) == (expected.finished.prompt_tokens, 20, "length")


def test_generate_token_ids_and_stop(model_server, client: InferenceClient) -> None:
    ids = client.tokenize("The cache page holds").token_ids
    free = client.complete(token_ids=ids, max_tokens=20, temperature=0, ignore_eos=True)
    stop = re.search(r"[a-z]{2}", free.text).group()
    r = kvserve("generate", ",".join(map(str, ids)), "--token-ids", "--address", model_server.address,
                "--max-tokens", "20", "--temperature", "0", "--ignore-eos", "--stop", "zzzz", "--stop", stop)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == free.text[:free.text.index(stop)].rstrip("\n")
    assert GENERATE_SUMMARY.search(r.stderr)[4] == "stop"


def test_generate_n_prints_each_sequence(model_server, client: InferenceClient) -> None:
    prompt = "The cache page holds the key and value vectors"
    sampled = client.complete(prompt, max_tokens=8, temperature=1.0, seed=3, n=3, ignore_eos=True)
    r = kvserve("generate", prompt, "--address", model_server.address, "--max-tokens", "8", "--temperature", "1",
                "--seed", "3", "-n", "3", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    expected = "".join(f"--- sequence {c.finished.index} (length, 8 tokens) ---\n{c.text}\n" for c in sampled.choices)
    assert r.stdout.replace("\r\n", "\n") == expected.replace("\r\n", "\n")


def test_generate_reports_a_server_error(model_server) -> None:
    r = kvserve("generate", "hello", "--address", model_server.address, "--temperature", "-1")
    assert r.returncode == 1
    assert r.stderr.startswith("kvserve generate: INVALID_ARGUMENT: ")
    assert "temperature" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args, said", [
    (["hello", "--max-tokens", "-1"], "max_tokens -1 does not fit the request"),
    (["hello", "--seed", "-5"], "seed -5 does not fit the request"),
    (["1 99999999999", "--token-ids"], "token ids must be integers in [0, 2^31), got 99999999999"),
    (["hello", "-n", "0"], "n is the number of sequences to sample, at least 1; got 0"),
    (["hello", "--timeout", "-1"], "timeout is a number of seconds > 0 and under 1e9 (gRPC's deadlines end there), "
                                   "or None for no deadline; got -1.0"),
    (["hello", "--timeout", "1e10"], "timeout is a number of seconds > 0 and under 1e9 (gRPC's deadlines end "
                                     "there), or None for no deadline; got 10000000000.0"),   # failed at once
    (["hello", "--address", "127.0.0.1:99999"], "address 127.0.0.1:99999: the port must be in 1..65535"),
])
def test_values_no_request_can_carry_are_one_line_and_exit_2(args, said) -> None:
    r = kvserve("generate", "--address", "127.0.0.1:1", *args)   # refused before any call
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"kvserve generate: {said}")


@pytest.mark.parametrize("interval", ["0", "inf", "nan"])
def test_top_refuses_an_interval_it_cannot_sleep(interval) -> None:
    r = kvserve("top", "--once", "--interval", interval, "--address", "127.0.0.1:1")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("kvserve top: --interval must be more than 0 seconds and at most 86400")


@pytest.mark.parametrize("strict", [False, True])
def test_stdin_that_is_not_utf8_is_one_line_and_exit_2(strict) -> None:
    """strict: as under a UTF-8 locale (not C's), where Python reads stdin strictly: it was a
    UnicodeDecodeError's traceback."""
    import os
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"} if strict else None
    r = subprocess.run([sys.executable, "-m", "kvserve.services.cli.main", "generate", "-", "--address",
                        "127.0.0.1:1"], input=b"Hello \xff\xfe", capture_output=True, timeout=60, env=env)
    assert r.returncode == 2 and b"Traceback" not in r.stderr
    assert r.stderr.decode().strip() == "kvserve generate: prompt is not valid UTF-8 text"
    r = subprocess.run([sys.executable, "-m", "kvserve.services.cli.main", "tokenize", "--address",
                        "127.0.0.1:1"], input=b"Hello \xff\xfe", capture_output=True, timeout=60, env=env)
    assert r.returncode == 2 and b"Traceback" not in r.stderr, r.stderr


def test_generate_with_no_server_is_unavailable() -> None:
    r = kvserve("generate", "hello", "--address", "127.0.0.1:1")
    assert r.returncode == 1
    assert r.stderr.startswith("kvserve generate: UNAVAILABLE: ")


def long_generate(address: str) -> subprocess.Popen:
    """`kvserve generate` of 1,900 tokens, running."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvserve.services.cli.main", "generate", "The cache page", "--address", address,
         "--max-tokens", "1900", "--ignore-eos", "--temperature", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8", errors="replace",
        cwd=REPO)


def test_ctrl_c_cancels_generate(model_server, client: InferenceClient) -> None:
    before = client.server_stats()
    proc = long_generate(model_server.address)
    try:
        # Streaming once its first text is out. (Polling the server's stats until it shows the
        # request running missed the whole ~3 s stream once, with a benchmark on the same cores.)
        assert proc.stdout.read(1), proc.communicate()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "[cancelled]" in err and "Traceback" not in err
    deadline = time.monotonic() + 10
    while (stats := client.server_stats()).running:  # aborted within an engine step or so
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert stats.requests_aborted == before.requests_aborted + 1
    assert stats.kvcache.used_pages == 0


def test_a_generation_cancelled_at_the_server_exits_1(model_server, client: InferenceClient) -> None:
    """Cancelled by another client (or ended by a drain), it printed `finish abort` and exited 0:
    a script could not tell a cut-off answer from a whole one."""
    proc = long_generate(model_server.address)
    try:
        assert proc.stdout.read(1), proc.communicate()
        [request_id] = list(model_server.servicer.engine._live)
        client.cancel(request_id)
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1 and "finish abort" in err and "Traceback" not in err, err


def test_chat_reuses_the_conversation_from_the_cache(model_server, client: InferenceClient) -> None:
    page = client.model_info().page_size
    turns = "What is a page?\nAnd a prefix tree?\nThanks, and eviction?\n/reset\nWhat is a page?\n/quit\nnot sent\n"
    r = kvserve("chat", "--address", model_server.address, "--max-tokens", "16", "--temperature", "0",
                "--system", "You are a helpful assistant for the kvserve model server; answer briefly.",
                stdin=turns)
    assert r.returncode == 0, r.stderr
    summaries = [tuple(map(int, m.groups())) for m in TURN_SUMMARY.finditer(r.stderr)]
    assert [s[0] for s in summaries] == [1, 2, 3, 1], r.stderr  # /reset restarts; /quit stops before "not sent"
    assert "[history cleared]" in r.stderr
    assert r.stdout.count("\n") >= 4 and r.stdout.strip()  # 4 replies, each ending its line
    (_, p1, _, _), (_, p2, c2, _), (_, p3, c3, _), (_, p4, c4, _) = summaries
    # each turn's prompt holds the previous prompt, its reply and the new user line ...
    assert p1 + 4 < p2 < p3  # 4: <|end|><|user|> ... <|end|><|assistant|>
    # ... and every full page of the previous turn's prompt comes from the prefix cache
    assert c2 >= p1 // page * page > 0
    assert c3 >= p2 // page * page > 0
    # after /reset the first turn is sent again: same prompt, all but its last page cached
    assert p4 == p1 and c4 == (p1 - 1) // page * page


def test_chat_error_keeps_going_and_exits_1(model_server) -> None:
    r = kvserve("chat", "--address", model_server.address, "--max-tokens", "100000", stdin="hello\n")
    assert r.returncode == 1
    assert r.stderr.startswith("kvserve chat: INVALID_ARGUMENT: ")
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args, said", [
    (["--max-tokens", "-1"], "max_tokens -1 does not fit the request"),
    (["--seed", "-5"], "seed -5 does not fit the request"),
])
def test_chat_refuses_values_no_turn_can_carry_before_the_first_turn(args, said) -> None:
    """As generate does (exit 2, one line), not a refusal at every turn and exit 1 at the end."""
    r = kvserve("chat", "--address", "127.0.0.1:1", *args, stdin="hello\nagain\n")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"kvserve chat: {said}") and len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_help_does_not_import_torch_or_grpc(command: str) -> None:
    code = ("import sys; from kvserve.services.cli import main as cli\n"
            f"try: cli.main(['{command}', '--help'])\nexcept SystemExit: pass\n"
            "print(sorted(m for m in ('torch', 'grpc') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ}, timeout=TIMEOUT_S)
    assert r.stdout.strip().endswith("[]"), r.stdout + r.stderr


def test_ctrl_c_while_a_command_waits_on_a_silent_server_is_one_line() -> None:
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()   # connections complete, and nothing ever answers
    proc = None
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.services.cli.main", "stats", "--address",
                                 f"127.0.0.1:{silent.getsockname()[1]}"], stderr=subprocess.PIPE, text=True)
        # its call's first bytes (HTTP/2's preface) have come: it is waiting for the server's answer
        silent.settimeout(60)
        conn, _ = silent.accept()
        conn.settimeout(60)
        assert conn.recv(1)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 130, stderr
        assert "Traceback" not in stderr and stderr.strip().endswith("kvserve stats: interrupted")
        conn.close()
    finally:
        silent.close()
        if proc is not None and proc.poll() is None:
            proc.kill()


def test_tokenize_and_detokenize_from_the_shell(model_server, client: InferenceClient) -> None:
    prompt = "The cache page holds"
    ids = client.tokenize(prompt).token_ids
    r = kvserve("tokenize", prompt, "--address", model_server.address, "--tokens")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"{len(ids)} tokens: " + ", ".join(map(str, ids))
    assert [int(line.split("\t")[0]) for line in lines[1:]] == list(ids)
    r = kvserve("detokenize", ",".join(map(str, ids)), "--address", model_server.address)
    assert (r.returncode, r.stdout) == (0, prompt + "\n"), r.stderr
    ascii_only = subprocess.run([sys.executable, "-m", "kvserve.services.cli.main", "detokenize",
                                 ",".join(map(str, client.tokenize("café ok").token_ids)), "--address",
                                 model_server.address], capture_output=True, cwd=REPO, timeout=TIMEOUT_S,
                                env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert (ascii_only.returncode, ascii_only.stdout) == (0, b"caf? ok\n"), ascii_only.stderr   # no traceback
    r = kvserve("detokenize", "1", "x", "--address", model_server.address)
    assert r.returncode == 2 and "token ids are integers, got '1 x'" in r.stderr
    r = kvserve("detokenize", str(1 << 30), "--address", model_server.address)
    assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr and "outside the vocabulary" in r.stderr


@pytest.mark.parametrize("n", [1, 2])
def test_generate_says_where_a_queued_request_stands_and_sums_n_sequences(monkeypatch, capsys, n) -> None:
    """A queued request showed nothing (the CLI looked hung); with n = 2 the summary counted one
    sequence's tokens."""
    from kvserve.clients import cli
    from kvserve.clients.inference_client import Chunk, Finished, Queued
    from kvserve.services.cli.main import build_parser

    events = [Queued(2, 3100), Queued(1, 1500), Queued(0, 0)]
    for i in range(n):
        events += [Chunk((5, 6), "ab", index=i), Finished("length", 3, 2, 0, 10.0, 20.0 + i, index=i)]

    class Stream(list):
        def cancel(self) -> None:
            pass

    class Client:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def generate(self, **_):
            return Stream(events)

    monkeypatch.setattr(cli, "_client", lambda args, command, timeout=None: Client())
    args = build_parser().parse_args(["generate", "hello", "-n", str(n)])
    assert args.func(args) == 0
    err = capsys.readouterr().err
    assert "[queued: position 2, about 3.1 s]" in err and "[queued: position 1, about 1.5 s]" in err
    assert "position 0" not in err and f"{2 * n} completion tokens" in err, err
