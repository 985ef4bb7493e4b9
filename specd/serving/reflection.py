"""Server reflection under both names clients ask for: grpc.reflection.v1 and v1alpha.

grpcio-reflection serves only v1alpha; current clients (grpcurl, Postman, grpcui) ask v1
first. The two protocols differ only in their package name (the messages are field for field
the same), so one servicer answers both, and the v1 file is added to the descriptor pool so
that a client can also describe the v1 service itself.
"""

from __future__ import annotations

from typing import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Reflection v1 and v1alpha on `server`, listing `service_names` and both reflections."""
    _add_v1_file(descriptor_pool.Default())
    names = [*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME]
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)  # v1alpha
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": v1}),))


def _add_v1_file(pool: descriptor_pool.DescriptorPool) -> None:
    """grpc/reflection/v1/reflection.proto, made from the v1alpha file by renaming its package."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    proto.ClearField("options")
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = _v1_type(field.type_name)
    for method in proto.service[0].method:
        method.input_type, method.output_type = _v1_type(method.input_type), _v1_type(method.output_type)
    pool.Add(proto)


def _v1_type(name: str) -> str:
    return name.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
