"""Listen addresses: parse, validate, and prepare them for binding.

Accepted forms (the ones gRPC itself understands):
    host:port          127.0.0.1:50061, localhost:0, 0.0.0.0:50061
    [ipv6]:port        [::1]:50061, [::]:0
    unix:///abs/path   a Unix socket, absolute path
    unix:rel/path      a Unix socket, path relative to the working directory
Port 0 asks the OS for a free port.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import socket
import stat
from dataclasses import dataclass

# sun_path is 108 bytes on Linux, one of them the terminating NUL.
MAX_UNIX_PATH_BYTES = 107

_HOSTNAME = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?$")


@dataclass(frozen=True)
class ListenAddress:
    """A validated listen address: TCP (host, port) or a Unix socket path."""

    host: str = ""  # TCP host without brackets; "" for a Unix socket
    port: int = 0  # TCP port; 0 = any free port
    unix_path: str = ""  # socket path as given; "" for TCP

    @property
    def is_unix(self) -> bool:
        return bool(self.unix_path)

    def grpc_target(self) -> str:
        """The string to hand to ``server.add_insecure_port``."""
        if self.is_unix:
            if os.path.isabs(self.unix_path):
                return f"unix://{self.unix_path}"
            return f"unix:{self.unix_path}"
        return _join_host_port(self.host, self.port)

    def with_port(self, port: int) -> str:
        """The address clients dial once bound: the real port, or unix:///abs/path."""
        if self.is_unix:
            return f"unix://{os.path.abspath(self.unix_path)}"
        return _join_host_port(self.host, port)


def parse_address(text: str) -> ListenAddress:
    """Parse ``text`` into a ListenAddress; raise ValueError saying what is wrong."""
    text = text.strip()
    if not text:
        raise ValueError("empty listen address; expected host:port, [ipv6]:port or unix:PATH")
    if text.startswith("unix:"):
        return _parse_unix(text)
    return _parse_tcp(text)


def parse_flag(flag: str, text: str) -> ListenAddress:
    """parse_address for a command-line flag: the error names the flag."""
    try:
        return parse_address(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def check_tcp_listen(flag: str, text: str) -> None:
    """A host:port flag (HTTP: uvicorn serves TCP; metrics) refused at start, naming the flag,
    before any model loads; empty: not asked for."""
    if text and parse_flag(flag, text).is_unix:
        raise ValueError(f"{flag} must be host:port, got {text!r}")


def check_dial(flag: str, text: str, what: str = "a server") -> None:
    """An address to dial: a Unix socket, or host:port with a port from 1 to 65535 (gRPC would dial
    a port past it modulo 65,536, and one it cannot parse for as long as its timeout allows)."""
    address = parse_flag(flag, text)
    if not address.is_unix and address.port == 0:
        raise ValueError(f"{flag} {text}: {what} is dialled on a port from 1 to 65535, not 0")


class CannotListen(OSError):
    """A server cannot listen on the address asked for: in use, or not permitted."""


@contextlib.contextmanager
def private_umask():
    """While a Unix socket is bound: no permission for users outside its owner and group, from
    the moment it exists (a chmod after the bind left a window in which a connection got in). A
    Unix socket counts as private (`is_private`), and under a umask of 0 it was open to every
    user of the host. The group keeps what the umask gave it (a pod's containers may share one
    by fsGroup). The umask is the process's: a file another thread makes meanwhile is only
    closed to others too."""
    before = os.umask(0o077)
    os.umask(before | 0o007)
    try:
        yield
    finally:
        os.umask(before)


def remove_stale_socket(path: str) -> None:
    """Delete a socket file left behind by a server that is gone.

    A live server still listening on ``path`` is not disturbed (OSError), and a
    file that is not a socket is never deleted (ValueError): both would mean
    the address is wrong, not stale.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"{path} exists and is not a Unix socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # nobody accepts on it: stale
        return
    finally:
        probe.close()
    raise CannotListen(f"unix socket {path} is in use by a running server")


def _parse_unix(text: str) -> ListenAddress:
    if text.startswith("unix://"):
        path = text[len("unix://"):]
        if not path.startswith("/"):
            raise ValueError(
                f"{text!r}: unix:// needs an absolute path (unix:///tmp/kv.sock); "
                "write unix:relative/path for a relative one"
            )
    else:
        path = text[len("unix:"):]
    if not path or path.endswith("/"):
        raise ValueError(f"{text!r}: missing socket file name after 'unix:'")
    if len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
        raise ValueError(
            f"{text!r}: socket path is {len(os.fsencode(path))} bytes, "
            f"longer than the {MAX_UNIX_PATH_BYTES} a Unix socket allows"
        )
    return ListenAddress(unix_path=path)


def _parse_tcp(text: str) -> ListenAddress:
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"{text!r}: expected [ipv6]:port, e.g. [::1]:50061")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{text!r}: {host!r} is not an IPv6 address") from None
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"{text!r}: missing port; expected host:port, e.g. 127.0.0.1:50061")
        if ":" in host:
            raise ValueError(f"{text!r}: put IPv6 addresses in brackets, e.g. [::1]:50061")
        if not host:
            raise ValueError(f"{text!r}: missing host; use 0.0.0.0:PORT to listen on all interfaces")
        _check_host(text, host)
    return ListenAddress(host=host, port=_parse_port(text, port_text))


def _check_host(text: str, host: str) -> None:
    if re.fullmatch(r"[0-9.]+", host):  # looks numeric: must be a real IPv4 address
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"{text!r}: {host!r} is not an IPv4 address") from None
    elif not _HOSTNAME.match(host):
        raise ValueError(f"{text!r}: {host!r} is not a valid host name")


def _parse_port(text: str, port_text: str) -> int:
    if not (port_text.isascii() and port_text.isdigit()):
        raise ValueError(f"{text!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"{text!r}: port {port} is out of range 0-65535")
    return port


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_local_port() -> str:
    """127.0.0.1:PORT with a port free right now, for a child process to listen on (a private
    endpoint its parent reads; another process could take it first, which the child reports)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def is_private(address: str) -> bool:
    """A Unix socket or a loopback host: reachable from this host (this pod) alone."""
    if address.startswith("unix:"):
        return True
    host = parse_address(address).host
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
