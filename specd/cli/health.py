"""`specd health`: ask a service's grpc.health.v1 whether it serves; exit 0 only if SERVING.

Kubernetes' native gRPC probes cannot speak TLS, so a pod serving TLS probes itself with this
command (an exec probe; deploy/k8s/components/tls): the same check, over TLS, with the pod's own
certificate when the server asks for a client certificate (mTLS).
"""

from __future__ import annotations

import argparse
import sys

from specd.cli import connect


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("health", help="check that a specd service serves (exit 0 if SERVING)")
    parser.add_argument("--address", default="localhost:50051",
                        help="the service's HOST:PORT (default: %(default)s, the coordinator's default)")
    parser.add_argument("--service", default="",
                        help="health service name to ask about (default: '', the server as a whole)")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for the answer (default: %(default)s)")
    connect.add_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with connect.open_channel(args.address, args) as channel:  # a ConfigError exits 2 (specd.cli.main)
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            print(f"{exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
