"""The manager's server answers grpc.health.v1 and server reflection (grpcurl, k8s probes)."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvserve.kvcache.v1 import kvcache_pb2 as pb
from tests.kvcache.conftest import KV, rpc_error

KVCACHE = "kvserve.kvcache.v1.KVCacheManager"
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


def test_health_is_serving_for_the_server_and_the_manager(kv: KV) -> None:
    stub = health_pb2_grpc.HealthStub(kv.channel)
    for service in ("", KVCACHE):
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING, service
    err = rpc_error(lambda: stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def reflect(kv: KV, *requests: reflection_pb2.ServerReflectionRequest) -> list:
    stub = reflection_pb2_grpc.ServerReflectionStub(kv.channel)
    return list(stub.ServerReflectionInfo(iter(requests), timeout=5))


def test_reflection_lists_and_describes_the_manager(kv: KV) -> None:
    listed, described, missing = reflect(
        kv,
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=KVCACHE),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvserve.kvcache.v1.NoSuchThing"),
    )
    names = {s.name for s in listed.list_services_response.service}
    assert {KVCACHE, HEALTH, REFLECTION} <= names

    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in described.file_descriptor_response.file_descriptor_proto]
    (proto,) = [f for f in files if f.package == "kvserve.kvcache.v1"]
    # kvcache.proto also holds KVCacheEvents, the read-only face the model service serves
    assert {s.name for s in proto.service} == {"KVCacheManager", "KVCacheEvents"}
    (service,) = [s for s in proto.service if s.name == "KVCacheManager"]
    methods = {m.name: m for m in service.method}
    assert set(methods) == set(pb.DESCRIPTOR.services_by_name["KVCacheManager"].methods_by_name)
    assert (methods["Step"].input_type, methods["Step"].output_type) == (
        ".kvserve.kvcache.v1.StepRequest", ".kvserve.kvcache.v1.StepResponse")
    assert methods["WatchEvents"].server_streaming

    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_reflection_descriptor_database_resolves_the_step_method(kv: KV) -> None:
    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(kv.channel))
    step = pool.FindServiceByName(KVCACHE).methods_by_name["Step"]
    assert step.output_type.full_name == "kvserve.kvcache.v1.StepResponse"
    assert [f.name for f in step.input_type.fields] == [f.name for f in pb.StepRequest.DESCRIPTOR.fields]
