from kvserve.inference.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LaneMetadata(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class LaneCall(_message.Message):
    __slots__ = ("request", "metadata", "timeout_ms", "ping_interval_ms")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PING_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    request: _inference_pb2.GenerateRequest
    metadata: _containers.RepeatedCompositeFieldContainer[LaneMetadata]
    timeout_ms: int
    ping_interval_ms: int
    def __init__(self, request: _Optional[_Union[_inference_pb2.GenerateRequest, _Mapping]] = ..., metadata: _Optional[_Iterable[_Union[LaneMetadata, _Mapping]]] = ..., timeout_ms: _Optional[int] = ..., ping_interval_ms: _Optional[int] = ...) -> None: ...

class LaneStatus(_message.Message):
    __slots__ = ("code", "details", "trailing_metadata")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILING_METADATA_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    trailing_metadata: _containers.RepeatedCompositeFieldContainer[LaneMetadata]
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., trailing_metadata: _Optional[_Iterable[_Union[LaneMetadata, _Mapping]]] = ...) -> None: ...
