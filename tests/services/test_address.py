"""Listen-address parsing and stale Unix socket handling."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kvserve.services.plumbing.address import ListenAddress, parse_address, remove_stale_socket


@pytest.mark.parametrize(
    ("text", "expected", "target"),
    [
        ("127.0.0.1:50061", ListenAddress(host="127.0.0.1", port=50061), "127.0.0.1:50061"),
        ("localhost:0", ListenAddress(host="localhost", port=0), "localhost:0"),
        ("0.0.0.0:1", ListenAddress(host="0.0.0.0", port=1), "0.0.0.0:1"),
        ("kvcache.default.svc:65535", ListenAddress(host="kvcache.default.svc", port=65535),
         "kvcache.default.svc:65535"),
        ("  127.0.0.1:7  ", ListenAddress(host="127.0.0.1", port=7), "127.0.0.1:7"),
        ("[::1]:50061", ListenAddress(host="::1", port=50061), "[::1]:50061"),
        ("[::]:0", ListenAddress(host="::", port=0), "[::]:0"),
        ("unix:///tmp/kv.sock", ListenAddress(unix_path="/tmp/kv.sock"), "unix:///tmp/kv.sock"),
        ("unix:run/kv.sock", ListenAddress(unix_path="run/kv.sock"), "unix:run/kv.sock"),
        ("unix:/tmp/kv.sock", ListenAddress(unix_path="/tmp/kv.sock"), "unix:///tmp/kv.sock"),
    ],
)
def test_parses_good_addresses(text: str, expected: ListenAddress, target: str) -> None:
    address = parse_address(text)
    assert address == expected
    assert address.grpc_target() == target


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty listen address"),
        ("50061", "missing port"),
        ("127.0.0.1", "missing port"),
        (":50061", "missing host"),
        ("::1:50061", "IPv6 addresses in brackets"),
        ("[::1]50061", r"expected \[ipv6\]:port"),
        ("[::1", r"expected \[ipv6\]:port"),
        ("[example.com]:80", "is not an IPv6 address"),
        ("127.0.0.1:http", "is not a number"),
        ("127.0.0.1:-1", "is not a number"),
        ("127.0.0.1:", "is not a number"),
        ("127.0.0.1:65536", "out of range"),
        ("256.1.1.1:80", "is not an IPv4 address"),
        ("bad_host!:80", "not a valid host name"),
        ("unix://relative.sock", "needs an absolute path"),
        ("unix:", "missing socket file name"),
        ("unix:///tmp/", "missing socket file name"),
        ("unix:///tmp/" + "x" * 120, "longer than the 107"),
    ],
)
def test_rejects_bad_addresses(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_address(text)


def test_bound_address_reports_real_port_and_absolute_socket_path() -> None:
    assert parse_address("127.0.0.1:0").with_port(43123) == "127.0.0.1:43123"
    assert parse_address("[::1]:0").with_port(43123) == "[::1]:43123"
    assert parse_address("unix:kv.sock").with_port(1) == f"unix://{os.getcwd()}/kv.sock"


def _socket_file(path: Path, *, listening: bool) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    if listening:
        sock.listen()
    return sock


def test_stale_socket_is_removed(tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"
    _socket_file(path, listening=False).close()  # closing leaves the file behind
    remove_stale_socket(str(path))
    assert not path.exists()


def test_live_socket_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"
    with _socket_file(path, listening=True):
        with pytest.raises(OSError, match="in use"):
            remove_stale_socket(str(path))
        assert path.exists()


def test_regular_file_is_never_removed(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    with pytest.raises(ValueError, match="not a Unix socket"):
        remove_stale_socket(str(path))
    assert path.read_text() == "keep me"


def test_missing_socket_is_fine(tmp_path: Path) -> None:
    remove_stale_socket(str(tmp_path / "absent.sock"))
