"""TLS for kvserve's servers and channels: certificates from PEM files. A key without its
certificate is refused when the config is made; the files are read (and a wrong path or a file
that is not PEM, a key that is not the certificate's, a CA file with no certificate refused,
with a sentence) when a server starts or, for a client, when it first
connects: a config's check_files() reads them all up front.

TLS covers TCP addresses. A Unix socket is reachable only on its host (in Kubernetes, inside the
pod) and its file permissions guard it, so servers serve it in plaintext beside their TLS ports.

A server's certificate, key and client CA are read again when their files change (cert-manager
renews a Secret, the kubelet swaps the files): gRPC asks at each new connection (looked at most
once a second), the lane's and the HTTP front's contexts every 10 s. Files that do not load
leave the certificate in use, said in the log. A client's certificate is read when its channel
is made.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

log = logging.getLogger(__name__)

RELOOK_S = 1.0           # gRPC asks at every handshake: the files are looked at most this often
CONTEXT_RELOOK_S = 10.0  # how often a server's SSLContext (the lane's, HTTP's) looks at its files


class _Files:
    """Whether any of some files was replaced or rewritten since the last look."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        self.paths = tuple(p for p in paths if p)
        self._seen = self._now()
        self._looked = time.monotonic()

    def _now(self) -> tuple:
        out = []
        for path in self.paths:
            try:
                st = os.stat(path)   # through a symlink: a Secret's swap names new files
                out.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    def changed(self, every_s: float = 0.0) -> bool:
        now = time.monotonic()
        if now - self._looked < every_s:
            return False
        self._looked = now
        seen = self._now()
        if seen == self._seen:
            return False
        self._seen = seen
        return True



def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path!r}: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{what} {path!r} is not PEM (no -----BEGIN line)")
    return data


def _pair(cert: str, key: str) -> tuple[bytes, bytes]:
    """(key, certificate chain) read, each PEM, and the key the certificate's own: gRPC's C core
    says only that it could not listen (or, in a client, that no handshake could be made)."""
    pair = (_read(key, "TLS key"), _read(cert, "TLS certificate"))
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(f"the TLS key {key!r} is not the key of the certificate {cert!r}") from None
        raise ValueError(f"the TLS certificate {cert!r} and key {key!r} do not load as a certificate and its "
                         "key: are they swapped?") from None
    except OSError as exc:
        raise ValueError(f"cannot read the TLS certificate {cert!r} or key {key!r}: {exc.strerror or exc}") from None
    return pair


def _ca(path: str, what: str) -> bytes:
    """A CA bundle read, holding at least one certificate."""
    data = _read(path, what)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except ssl.SSLError:
        raise ValueError(f"{what} {path!r} holds no certificate") from None
    return data


@dataclass(frozen=True)
class ServerTLS:
    cert: str
    key: str
    client_ca: str = ""   # require client certificates signed by this CA (mutual TLS)

    @classmethod
    def of(cls, cert: str, key: str, client_ca: str = "", prefix: str = "--tls") -> ServerTLS | None:
        """None when no certificate is given (plaintext); ValueError for half a pair."""
        if not cert and not key:
            if client_ca:
                raise ValueError(f"{prefix}-client-ca needs {prefix}-cert and {prefix}-key")
            return None
        if not (cert and key):
            raise ValueError(f"give both {prefix}-cert and {prefix}-key")
        return cls(cert, key, client_ca)

    def files(self) -> tuple[str, ...]:
        return self.cert, self.key, self.client_ca

    def _configuration(self):
        import grpc   # here, not at the top: configs import this module, and `kvserve --help` loads no gRPC
        pair = _pair(self.cert, self.key)
        ca = _ca(self.client_ca, "client CA") if self.client_ca else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def credentials(self) -> grpc.ServerCredentials:
        """Read again, for the connections after it, when the files change."""
        import grpc
        files = _Files(self.files())   # before the files are read: a change in between is read again
        first = self._configuration()

        def fetch():   # from gRPC's core at each handshake: None keeps the certificate in use
            if not files.changed(RELOOK_S):
                return None
            try:
                configuration = self._configuration()
            except Exception as exc:   # noqa: BLE001 - a handshake must not fail for it
                log.error("the TLS files changed but do not load (%s); the certificate in use stays", exc)
                return None
            log.info("TLS certificate %s read again", self.cert)
            return configuration
        return grpc.dynamic_ssl_server_credentials(first, fetch, require_client_authentication=bool(self.client_ca))

    def ssl_context(self) -> ssl.SSLContext:
        """The same for a server outside gRPC (the lane): client certificates the CA signed
        required when it is given."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        if self.client_ca:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cafile=self.client_ca)
        return context

    def keep_current(self, context: ssl.SSLContext) -> Callable[[], None]:
        """From a running loop: the server serving `context` (ssl_context()'s, or the HTTP
        server's) hands each handshake to a context made afresh from the files once they changed
        (looked at every CONTEXT_RELOOK_S), through its SNI callback, called at every handshake,
        a name sent or not. `context` itself is never changed: a retired client CA is no longer
        trusted, and files that do not load leave the one in use whole. Returns what stops it."""
        loop = asyncio.get_running_loop()
        files = _Files(self.files())
        timer: list[asyncio.TimerHandle] = []

        def take(said: bool) -> None:
            try:
                _pair(self.cert, self.key)   # a sentence for a pair that does not load
                fresh = self.ssl_context()
            except (ValueError, OSError, ssl.SSLError) as exc:
                log.error("the TLS files changed but do not load (%s); the certificate in use stays", exc)
                return
            context.sni_callback = lambda connection, _name, _context: setattr(connection, "context", fresh)
            if said:
                log.info("TLS certificate %s read again", self.cert)

        def look() -> None:
            if files.changed():
                take(said=True)
            timer[:] = [loop.call_later(CONTEXT_RELOOK_S, look)]
        take(said=False)   # read after the files' first look: a change since `context` was made is not missed
        timer.append(loop.call_later(CONTEXT_RELOOK_S, look))
        return lambda: timer[0].cancel()


@dataclass(frozen=True)
class ClientTLS:
    ca: str = ""            # the CA that signed the server's certificate ("": the system's roots)
    cert: str = ""          # this client's certificate and key, for mutual TLS
    key: str = ""
    server_name: str = ""   # the name to check the server's certificate against, when not the address's

    @classmethod
    def of(cls, ca: str = "", cert: str = "", key: str = "", enabled: bool = False, server_name: str = "",
           prefix: str = "--tls") -> ClientTLS | None:
        """None for plaintext: no file given and TLS not asked for. A server name to check asks
        for TLS (the system's roots without a CA), as the client's --tls-server-name does: alone,
        it left the channel in plaintext without a word."""
        if bool(cert) != bool(key):
            raise ValueError(f"give both {prefix}-cert and {prefix}-key, or neither")
        if not (ca or cert or enabled or server_name):
            return None
        return cls(ca, cert, key, server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        import grpc
        key, chain = _pair(self.cert, self.key) if self.cert else (None, None)
        return grpc.ssl_channel_credentials(
            root_certificates=_ca(self.ca, "CA certificate") if self.ca else None,
            private_key=key, certificate_chain=chain)

    def ssl_context(self) -> ssl.SSLContext:
        """The same for a client outside gRPC (the lane): the CA (or the system's roots), this
        client's certificate for mutual TLS."""
        context = ssl.create_default_context(cafile=self.ca or None)
        if self.cert:
            context.load_cert_chain(self.cert, self.key)
        return context

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def channel(address: str, tls: ClientTLS | None, options: list | tuple = ()) -> grpc.Channel:
    """A blocking channel: TLS when `tls` is given and the address is TCP."""
    import grpc
    if tls is not None and address.startswith("unix:"):
        tls.credentials()   # a Unix socket stays plaintext, but a bad file is still said at once
    if tls is None or address.startswith("unix:"):
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.credentials(), options=[*options, *tls.options()])


def aio_channel(address: str, tls: ClientTLS | None, options: list | tuple = ()) -> grpc.aio.Channel:
    """An asyncio channel: TLS when `tls` is given and the address is TCP."""
    import grpc
    if tls is not None and address.startswith("unix:"):
        tls.credentials()   # a Unix socket stays plaintext, but a bad file is still said at once
    if tls is None or address.startswith("unix:"):
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.credentials(), options=[*options, *tls.options()])
