"""Who may call what, as gRPC interceptors: API keys on the front services (api_keys.py), and
the manager's state kept to its pod.

- RequireApiKey: refuses, with UNAUTHENTICATED and before any work, every call to the named
  services without `authorization: Bearer KEY` metadata naming a known key. Health and
  reflection are never named, so probes and grpcurl's listing stay open.
- Refuse: a service this server has but will not serve in its configuration, PERMISSION_DENIED.
- LocalOrAdmin: lets a call to any but the open methods through only from a Unix socket or a
  loopback address (the manager's own pod) or with the admin token; others get
  PERMISSION_DENIED.
"""

from __future__ import annotations

import hmac
import ipaddress
import urllib.parse
from collections.abc import Awaitable, Callable

import grpc

from kvserve.services.plumbing.api_keys import ApiKeys, bearer_token
from kvserve.services.plumbing.handlers import like

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]

def _deny(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with `code`."""
    async def unary(request, context):
        await context.abort(code, message)

    async def streaming(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover  (makes this an async generator, as a streaming handler must be)

    return like(handler, streaming if handler.response_streaming else unary)


def _service_of(method: str) -> str:
    return method.lstrip("/").split("/", 1)[0]


class RequireApiKey(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys, services: set[str]) -> None:
        self.keys = keys
        self.services = services

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or _service_of(details.method) not in self.services:
            return handler
        why = self.keys.refusal(details.invocation_metadata)
        return handler if why is None else _deny(handler, grpc.StatusCode.UNAUTHENTICATED, why)


class Refuse(grpc.aio.ServerInterceptor):
    def __init__(self, service: str, why: str) -> None:
        self.service = service
        self.why = why

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or _service_of(details.method) != self.service:
            return handler
        return _deny(handler, grpc.StatusCode.PERMISSION_DENIED, self.why)


def is_local_peer(peer: str) -> bool:
    """A Unix socket or a loopback address: in Kubernetes, a container of the same pod. (Behind a
    service mesh whose sidecar forwards from loopback, listen on a Unix socket only, as
    deploy/model-service.yaml does.)"""
    if peer.startswith("unix:"):
        return True
    if peer.startswith("ipv4:"):
        return peer[5:].startswith("127.")
    if peer.startswith("ipv6:"):   # grpc writes the brackets escaped: ipv6:%5B::1%5D:5555
        host = urllib.parse.unquote(peer[5:]).rsplit(":", 1)[0].strip("[]")
        try:
            address = ipaddress.IPv6Address(host.split("%", 1)[0])   # (less any zone: fe80::1%eth0)
        except ValueError:
            return False
        return address.is_loopback or (address.ipv4_mapped is not None and address.ipv4_mapped.is_loopback)
    return False


class LocalOrAdmin(grpc.aio.ServerInterceptor):
    def __init__(self, service: str, open_methods: set[str], admin_token: str = "") -> None:
        self.service = service
        self.open_methods = open_methods
        self.admin_token = admin_token

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method.lstrip("/")
        if handler is None or _service_of(method) != self.service or method.split("/", 1)[1] in self.open_methods:
            return handler
        token = bearer_token(details.invocation_metadata)
        if self.admin_token and token is not None and hmac.compare_digest(token.encode(), self.admin_token.encode()):
            return handler
        return _guard_peer(handler, method.split("/", 1)[1])


def _guard_peer(handler: grpc.RpcMethodHandler, name: str) -> grpc.RpcMethodHandler:
    """The handler, behind a check of the caller's address (known only inside the call)."""
    message = (f"{name} shows or changes the manager's state: only its own pod (a Unix socket or loopback) "
               "or a caller with the admin token (--admin-token-file) may call it")

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

    return like(handler, behaviour)
