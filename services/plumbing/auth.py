"""Who may call what: API keys on the front services, and the manager's write RPCs kept to its pod.

- ApiKeys: `--api-keys FILE`, one `KEY TENANT` per line (# comments), read again on SIGHUP; a
  file that no longer parses leaves the keys in force as they were, and says why in the log.
- RequireApiKey: an interceptor refusing, with UNAUTHENTICATED and before any work, every call to
  the named services without `authorization: Bearer KEY` metadata naming a known key. Health and
  reflection are never named, so probes and grpcurl's listing stay open.
- LocalOrAdmin: an interceptor letting a call to any but the read-only methods through only from
  a Unix socket or a loopback address (the manager's own pod) or with the admin token; others
  get PERMISSION_DENIED.
"""

from __future__ import annotations

import hmac
import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

AUTHORIZATION = "authorization"
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


class ApiKeys:
    def __init__(self, path: str) -> None:
        self.path = path
        self._tenants = self._load()

    def __len__(self) -> int:
        return len(self._tenants)

    def _load(self) -> dict[str, str]:
        try:
            if Path(self.path).stat().st_size > MAX_KEY_FILE_BYTES:
                raise ValueError(f"API key file {self.path!r} is larger than {MAX_KEY_FILE_BYTES >> 20} MiB")
            text = Path(self.path).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read the API key file {self.path!r}: {exc.strerror or exc}") from None
        tenants: dict[str, str] = {}
        for number, line in enumerate(text.splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) != 2:
                raise ValueError(f"{self.path}:{number}: expected `KEY TENANT`, got {len(fields)} fields")
            key, tenant = fields
            if key in tenants:
                raise ValueError(f"{self.path}:{number}: a key listed twice")
            tenants[key] = tenant
        if not tenants:
            raise ValueError(f"the API key file {self.path!r} lists no key")
        return tenants

    def reload(self) -> None:
        """Read the file again; keep the keys in force if it no longer parses."""
        try:
            tenants = self._load()
        except ValueError as exc:
            log.error("API keys not reloaded, the %d in force stay: %s", len(self._tenants), exc)
            return
        self._tenants = tenants
        log.info("API keys reloaded from %s: %d keys", self.path, len(tenants))

    def reload_on_sighup(self) -> None:
        """From the main thread's running loop (the servers' serve())."""
        import asyncio
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload)

    def tenant(self, key: str | None) -> str | None:
        """The key's tenant; None for a missing or unknown key."""
        if not key:
            return None
        tenant = self._tenants.get(key)
        if tenant is None:
            return None
        return tenant


def _deny(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with `code`."""
    async def unary(request, context):
        await context.abort(code, message)

    async def streaming(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover  (makes this an async generator, as a streaming handler must be)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(streaming if handler.response_streaming else unary,
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def _service_of(method: str) -> str:
    return method.lstrip("/").split("/", 1)[0]


class RequireApiKey(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys, services: set[str]) -> None:
        self.keys = keys
        self.services = services

    async def intercept_service(self, continuation: Callable[..., Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or _service_of(details.method) not in self.services:
            return handler
        token = bearer_token(details.invocation_metadata)
        if token is None:
            return _deny(handler, grpc.StatusCode.UNAUTHENTICATED,
                         "this server requires an API key: send `authorization: Bearer KEY` metadata")
        if self.keys.tenant(token) is None:
            return _deny(handler, grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
        return handler


def is_local_peer(peer: str) -> bool:
    """A Unix socket or a loopback address: in Kubernetes, a container of the same pod."""
    if peer.startswith("unix:"):
        return True
    if peer.startswith("ipv4:"):
        return peer[5:].startswith("127.")
    if peer.startswith("ipv6:"):
        host = peer[5:].rsplit(":", 1)[0].strip("[]")
        return host in ("::1", "0:0:0:0:0:0:0:1") or host.startswith("::ffff:127.")
    return False


class LocalOrAdmin(grpc.aio.ServerInterceptor):
    def __init__(self, service: str, open_methods: set[str], admin_token: str = "") -> None:
        self.service = service
        self.open_methods = open_methods
        self.admin_token = admin_token

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method.lstrip("/")
        if handler is None or _service_of(method) != self.service or method.split("/", 1)[1] in self.open_methods:
            return handler
        token = bearer_token(details.invocation_metadata)
        if self.admin_token and token is not None and hmac.compare_digest(token, self.admin_token):
            return handler
        return _guard_peer(handler, method.split("/", 1)[1])


def _guard_peer(handler: grpc.RpcMethodHandler, name: str) -> grpc.RpcMethodHandler:
    """The handler, behind a check of the caller's address (known only inside the call)."""
    message = (f"{name} changes the manager's state: only its own pod (a Unix socket or loopback) or a "
               "caller with the admin token (--admin-token-file) may call it")

    if handler.response_streaming:
        inner = handler.unary_stream or handler.stream_stream

        async def behaviour(request, context):
            if not is_local_peer(context.peer()):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
            async for response in inner(request, context):
                yield response
    else:
        inner = handler.unary_unary or handler.stream_unary

        async def behaviour(request, context):
            if not is_local_peer(context.peer()):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
            return await inner(request, context)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return kinds[(handler.request_streaming, handler.response_streaming)](
        behaviour, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def read_token(path: str, what: str = "admin token") -> str:
    """A token from its file (a Kubernetes Secret mounted as a file), surrounding space removed."""
    if not path:
        return ""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {path!r}: {exc.strerror or exc}") from None
    if not token:
        raise ValueError(f"the {what} file {path!r} is empty")
    return token
