"""API keys and tokens, read from files; no gRPC here (configs import it, and `kvserve --help`
loads no gRPC).

- ApiKeys: `--api-keys FILE`, one `KEY TENANT` per line (# comments), read again on SIGHUP; a
  file that no longer parses leaves the keys in force as they were, and says why in the log.
- read_token: an admin token from its file (a Kubernetes Secret mounted as a file).
"""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import logging
import os
import signal
from pathlib import Path

log = logging.getLogger(__name__)

AUTHORIZATION = "authorization"
MAX_TENANT_CHARS = 256   # a tenant's name, as a key file or a gateway's metadata gives it
TENANT_METADATA = "kvserve-tenant"   # set by a trusted front (the gateway) for the worker behind it
MAX_KEY_FILE_BYTES = 16 << 20


def bearer_token(metadata) -> str | None:
    """The token of an `authorization: Bearer TOKEN` entry, if there is one."""
    for key, value in metadata or ():
        if key == AUTHORIZATION and isinstance(value, str):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def metadata_value(metadata, name: str) -> str | None:
    for key, value in metadata or ():
        if key == name and isinstance(value, str):
            return value
    return None


FILE_POLL_S = 10.0   # how often watch() looks whether the key file changed


def _signature(path: str) -> tuple | None:
    """What changes when the file is replaced or rewritten (a Kubernetes Secret's update swaps a
    symlink under its path: the file named is a new one)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


class ApiKeys:
    def __init__(self, path: str) -> None:
        self.path = path
        self._seen = _signature(path)   # the file as last read
        self._tenants = self._load()
        self._poll: asyncio.TimerHandle | None = None
        self._empty_pending = False   # the last look found the file emptied, and put it off

    def _load(self, empty_ok: bool = False) -> dict[bytes, str]:
        """The file's tenants by their keys' SHA-256: a lookup compares digests, never a key's
        bytes one by one (no timing tells a caller how much of a guess was right)."""
        try:
            if Path(self.path).stat().st_size > MAX_KEY_FILE_BYTES:
                raise ValueError(f"API key file {self.path!r} is larger than {MAX_KEY_FILE_BYTES >> 20} MiB")
            text = _utf8_text(Path(self.path).read_bytes(), f"the API key file {self.path!r}")
        except OSError as exc:
            raise ValueError(f"cannot read the API key file {self.path!r}: {exc.strerror or exc}") from None
        tenants: dict[bytes, str] = {}
        for number, line in enumerate(text.splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) != 2:
                raise ValueError(f"{self.path}:{number}: expected `KEY TENANT`, got {len(fields)} fields")
            key, tenant = fields
            if not (key.isascii() and key.isprintable()):   # a header or metadata value carries it
                raise ValueError(f"{self.path}:{number}: a key must be printable ASCII")
            if not (tenant.isascii() and tenant.isprintable()) or len(tenant) > MAX_TENANT_CHARS:
                # a gateway passes it on as metadata, and the worker takes no more
                raise ValueError(f"{self.path}:{number}: a tenant must be printable ASCII of at most "
                                 f"{MAX_TENANT_CHARS} characters")
            digest = _digest(key)
            if digest in tenants:
                raise ValueError(f"{self.path}:{number}: a key listed twice")
            tenants[digest] = tenant
        if not tenants and not empty_ok:
            raise ValueError(f"the API key file {self.path!r} lists no key")
        return tenants

    def reload(self, empty_seen_before: bool = True) -> None:
        """Read the file again; keep the keys in force if it no longer parses. A file emptied of
        keys revokes them all (an operator's answer to a leak): every call is refused then.
        `empty_seen_before` False (a look, not a signal): an empty file is taken only when the next
        look finds it empty still (an editor truncates a file before it writes it)."""
        seen = _signature(self.path)
        try:
            tenants = self._load(empty_ok=True)
        except ValueError as exc:
            self._seen = seen
            log.error("API keys not reloaded, the %d in force stay: %s", len(self._tenants), exc)
            return
        if not tenants and self._tenants and not empty_seen_before:
            return   # (not marked seen: the next look reads it again)
        self._seen = seen
        self._tenants = tenants
        if tenants:
            log.info("API keys reloaded from %s: %d keys", self.path, len(tenants))
        else:
            log.warning("API keys reloaded from %s: it lists none, so every call is refused until it does",
                        self.path)

    def watch(self) -> None:
        """From the main thread's running loop (the servers' serve()): the file is read again on
        SIGHUP and, within FILE_POLL_S, whenever it changes (on Kubernetes nothing sends a
        signal when a Secret is updated). A SIGHUP kept while the server started
        (keep_sighup_until_watched) is answered now."""
        if self._poll is not None:   # watched already
            return
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        if _sighup_kept:
            _sighup_kept.clear()
            self.reload()
        self._poll = loop.call_later(FILE_POLL_S, self._look)

    def _look(self) -> None:
        if _signature(self.path) != self._seen:
            self.reload(empty_seen_before=self._empty_pending)
            # an empty file put off leaves it unseen: the next look takes it if it is empty still
            self._empty_pending = _signature(self.path) != self._seen
        self._poll = asyncio.get_running_loop().call_later(FILE_POLL_S, self._look)

    def refusal(self, metadata) -> str | None:
        """Why a call with this metadata (or HTTP headers as pairs) is refused; None if its key is known."""
        token = bearer_token(metadata)
        if token is None:
            return "this server requires an API key: send `authorization: Bearer KEY` metadata"
        if self.tenant(token) is None:
            return "unknown API key"
        return None

    def tenant(self, key: str | None) -> str | None:
        """The key's tenant; None for a missing or unknown key."""
        if not key:
            return None
        return self._tenants.get(_digest(key))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()



def keep_sighup_until_watched() -> None:
    """From the main thread, before a server that checks keys starts (imports, model loading):
    SIGHUP's default action would kill the process, and every request a supervisor such as
    `kvserve up` had sent it meanwhile; kept instead, it is answered by a reload once the keys
    are read and watched (ApiKeys.watch)."""
    _sighup_kept.clear()
    signal.signal(signal.SIGHUP, lambda _signum, _frame: _sighup_kept.append(True))
    # `kvserve up` starts such a child with SIGHUP blocked (supervisor.py), so that one sent
    # before this line waited: it comes now, to the handler above.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGHUP,))


_sighup_kept: list[bool] = []   # a SIGHUP came while the server started


def _utf8_text(data: bytes, what: str) -> str:
    """A file's bytes as UTF-8 text, without the byte order mark some editors open it with."""
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not UTF-8 text (byte {skip + exc.start})") from None


def read_token(path: str, what: str = "admin token") -> str:
    """A token from its file (a Kubernetes Secret mounted as a file), surrounding space removed."""
    if not path:
        return ""
    try:
        token = _utf8_text(Path(path).read_bytes(), f"the {what} file {path!r}").strip()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {path!r}: {exc.strerror or exc}") from None
    if not token:
        raise ValueError(f"the {what} file {path!r} is empty")
    if not (token.isascii() and token.isprintable()):   # gRPC metadata carries it
        raise ValueError(f"the {what} file {path!r} holds characters other than printable ASCII")
    return token
