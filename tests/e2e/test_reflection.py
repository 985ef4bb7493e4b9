"""Server reflection answers under both protocol names, grpc.reflection.v1 and v1alpha.

The v1 client here is a plain stream-stream call to /grpc.reflection.v1.ServerReflection, with
the v1alpha message classes (the two protocols' messages are field for field the same).
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.conftest import CALL_TIMEOUT_S, running_stack

V1, V1ALPHA = "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"


@pytest.fixture(scope="module")
def stack(tiny_pair):
    with running_stack(tiny_pair[0], None) as stack:
        yield stack


def _ask(address: str, version: str, requests: list) -> list:
    with grpc.insecure_channel(address) as channel:
        if version == V1ALPHA:
            call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo
        else:
            call = channel.stream_stream(
                f"/{V1}/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
        return list(call(iter(requests), timeout=CALL_TIMEOUT_S))


def _file_names(response) -> set[str]:
    return {descriptor_pb2.FileDescriptorProto.FromString(raw).name
            for raw in response.file_descriptor_response.file_descriptor_proto}


@pytest.mark.parametrize("version", [V1, V1ALPHA])
@pytest.mark.parametrize("role", ["coordinator", "target"])
def test_reflection_lists_and_describes(stack, version, role):
    address = f"127.0.0.1:{getattr(stack, role).port}"
    service = {"coordinator": "specd.v1.Coordinator", "target": "specd.v1.TargetWorker"}[role]
    listed, described = _ask(address, version, [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=service),
    ])
    names = {s.name for s in listed.list_services_response.service}
    assert {service, "grpc.health.v1.Health", V1, V1ALPHA} <= names
    assert f"specd/v1/{role if role == 'coordinator' else 'target'}.proto" in _file_names(described)


@pytest.mark.parametrize("version", [V1, V1ALPHA])
def test_both_reflection_services_describe_themselves(stack, version):
    (v1_file,), (unknown,) = (_ask(f"127.0.0.1:{stack.coordinator.port}", version, [
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)]) for symbol in (V1, "no.such.Service"))
    assert "grpc/reflection/v1/reflection.proto" in _file_names(v1_file)
    assert unknown.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
