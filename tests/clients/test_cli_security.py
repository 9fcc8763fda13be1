"""`kvserve generate` and `kvserve stats` with --api-key (or KVSERVE_API_KEY) and the TLS flags,
against live model services. Run in-process through the real parser, and once as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.clients.inference_client import InferenceClient
from kvserve.services.cli.main import build_parser
from tests.clients.conftest import API_KEY, SERVER_NAME

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The cache page holds the key and value vectors"
GREEDY = ("--max-tokens", "10", "--temperature", "0", "--ignore-eos")


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    args = build_parser().parse_args(argv)
    rc = args.func(args)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture(scope="module")
def expected(model_server) -> str:
    with InferenceClient(model_server.address, timeout=60) as c:
        text = c.complete(PROMPT, max_tokens=10, temperature=0, ignore_eos=True).text
    return text.replace("\r\n", "\n").rstrip("\n")


def test_generate_with_an_api_key(keyed_server, expected, capsys, monkeypatch) -> None:
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    rc, out, err = cli(capsys, "generate", PROMPT, "--address", keyed_server.address, *GREEDY)
    assert rc == 1 and err.startswith("kvserve generate: UNAUTHENTICATED: "), err
    rc, out, err = cli(capsys, "generate", PROMPT, "--address", keyed_server.address, *GREEDY, "--api-key", API_KEY)
    assert rc == 0, err
    assert out.rstrip("\n") == expected
    monkeypatch.setenv("KVSERVE_API_KEY", "not-a-key")   # --api-key wins over the environment
    rc, out, err = cli(capsys, "generate", PROMPT, "--address", keyed_server.address, *GREEDY, "--api-key", API_KEY)
    assert rc == 0, err


def test_the_key_from_the_environment_in_a_subprocess(keyed_server, expected) -> None:
    r = subprocess.run([sys.executable, "-m", "kvserve.services.cli.main", "generate", PROMPT,
                        "--address", keyed_server.address, *GREEDY],
                       env={**os.environ, "KVSERVE_API_KEY": API_KEY}, capture_output=True, text=True,
                       encoding="utf-8", errors="replace", cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == expected


def test_stats_with_an_api_key(keyed_server, capsys, monkeypatch) -> None:
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    rc, _, err = cli(capsys, "stats", "--address", keyed_server.address)
    assert rc == 1 and "UNAUTHENTICATED" in err
    rc, out, err = cli(capsys, "stats", "--address", keyed_server.address, "--api-key", API_KEY)
    assert rc == 0, err
    assert out.startswith("running 0, waiting 0")


def test_generate_over_tls(tls_server, certs, expected, capsys) -> None:
    rc, out, err = cli(capsys, "generate", PROMPT, "--address", tls_server.address, *GREEDY, "--tls-ca", certs.ca)
    assert rc == 0, err
    assert out.rstrip("\n") == expected
    rc, out, err = cli(capsys, "generate", PROMPT, "--address", tls_server.address, *GREEDY, "--tls-ca", certs.ca,
                       "--tls-server-name", SERVER_NAME)
    assert rc == 0 and out.rstrip("\n") == expected, err
    rc, _, err = cli(capsys, "generate", PROMPT, "--address", tls_server.address, *GREEDY, "--timeout", "10")
    assert rc == 1 and err.startswith("kvserve generate: UNAVAILABLE: "), err   # plaintext is refused


def test_generate_over_mutual_tls(mtls_server, certs, expected, capsys) -> None:
    rc, out, err = cli(capsys, "generate", PROMPT, "--address", mtls_server.address, *GREEDY, "--tls-ca", certs.ca,
                       "--tls-cert", certs.client.cert, "--tls-key", certs.client.key)
    assert rc == 0, err
    assert out.rstrip("\n") == expected
    rc, _, err = cli(capsys, "generate", PROMPT, "--address", mtls_server.address, *GREEDY, "--tls-ca", certs.ca,
                     "--timeout", "10")
    assert rc == 1 and "UNAVAILABLE" in err   # no client certificate


def test_bad_tls_flags_exit_2_with_a_sentence(certs, tmp_path, capsys) -> None:
    rc, _, err = cli(capsys, "generate", "hi", "--address", "127.0.0.1:1", "--tls-cert", certs.client.cert)
    assert rc == 2 and err.startswith("kvserve generate: give both --tls-cert and --tls-key"), err
    rc, _, err = cli(capsys, "chat", "--address", "127.0.0.1:1", "--tls-ca", str(tmp_path / "nope.pem"))
    assert rc == 2 and err.startswith("kvserve chat: cannot read CA certificate"), err
    rc, _, err = cli(capsys, "generate", "hi", "--address", "127.0.0.1:1", "--api-key", "two words")
    assert rc == 2 and "printable ASCII" in err, err
