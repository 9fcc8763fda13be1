"""The manager's errors and gRPC status codes, one table read both ways: the servicer ends a
call with the code of the KVCacheError it caught; the client raises the KVCacheError of the
code it got. A code the table does not hold (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, ...)
means the call did not reach a working manager: ManagerUnavailable."""

from __future__ import annotations

import grpc

from kvserve.kvcache_service.contract.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KVCacheError,
    ManagerUnavailable,
    NotFound,
    ResourceExhausted,
)

STATUS_OF: dict[type[KVCacheError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
}
ERROR_OF: dict[grpc.StatusCode, type[KVCacheError]] = {code: error for error, code in STATUS_OF.items()}


def error_from_rpc(exc: grpc.RpcError, address: str) -> KVCacheError:
    """The KVCacheError a failed call to the manager at `address` stands for."""
    code, details = exc.code(), exc.details() or ""
    error = ERROR_OF.get(code)
    if error is None:
        return ManagerUnavailable(f"the KV-cache manager at {address} did not answer ({code.name}: {details})")
    return error(details)
