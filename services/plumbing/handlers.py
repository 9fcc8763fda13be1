"""A gRPC method handler rebuilt around another behaviour, for interceptors that wrap or replace
what a method does (auth.py, malformed.py)."""

from __future__ import annotations

import grpc

_MAKE = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
         (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


def like(handler: grpc.RpcMethodHandler, behaviour, request_deserializer=None) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind (streaming or not, each way) running `behaviour`, parsing
    requests with `request_deserializer` (default: `handler`'s)."""
    return _MAKE[(handler.request_streaming, handler.response_streaming)](
        behaviour, request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer)
