"""Bearer-token auth on the Coordinator service (--auth-token-file).

Every Coordinator RPC without `authorization: Bearer TOKEN` ends UNAUTHENTICATED; health and
reflection stay open; the token reaches neither the coordinator's logs nor its spans.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from coordinator.auth import read_token
from coordinator.server import SERVICE_NAME
from specd.cli import bench as bench_cli
from specd.cli import build_parser
from specd.core.config import ConfigError
from specd.v1 import coordinator_pb2 as pb
from specd.v1 import coordinator_pb2_grpc
from tests.conftest import CALL_TIMEOUT_S, request, running_stack

TOKEN = "specd-test-" + secrets.token_hex(16)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "token"
    path.write_text(TOKEN + "\n")  # as `echo TOKEN > file` writes it: the newline is no part of it
    return str(path)


@pytest.fixture(scope="module")
def guarded(tiny_pair, token_file):
    """A target-only stack whose coordinator requires the token and records its spans in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    overrides = {"auth_token_file": token_file}
    with running_stack(tiny_pair[0], None, coordinator_overrides=overrides, tracer_providers={"coordinator": provider}) as stack:
        yield stack, exporter


def _calls(channel: grpc.Channel, metadata) -> dict:
    """Each Coordinator RPC once, as a thunk returning its (last) response."""
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    message = request(prompt="def add(a, b):", mode=pb.SPECULATION_MODE_OFF, max_new_tokens=4)
    return {
        "Generate": lambda: stub.Generate(message, metadata=metadata, timeout=CALL_TIMEOUT_S),
        "GenerateStream": lambda: list(stub.GenerateStream(message, metadata=metadata, timeout=CALL_TIMEOUT_S))[-1],
        "ModelInfo": lambda: stub.ModelInfo(pb.ModelInfoRequest(), metadata=metadata, timeout=CALL_TIMEOUT_S),
    }


WRONG = {
    "no metadata": None,
    "wrong token": [("authorization", "Bearer not-the-token")],
    "token without Bearer": [("authorization", TOKEN)],
    "token with a suffix": [("authorization", f"Bearer {TOKEN}x")],
    "token with a prefix": [("authorization", f"Bearer x{TOKEN}")],
    "another scheme": [("authorization", f"Basic {TOKEN}")],
    "token twice": [("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer not-the-token")],
}


@pytest.mark.parametrize("metadata", list(WRONG))
def test_every_coordinator_rpc_without_the_token_is_unauthenticated(guarded, metadata):
    stack, _ = guarded
    with grpc.insecure_channel(stack.address) as channel:
        for name, call in _calls(channel, WRONG[metadata]).items():
            with pytest.raises(grpc.RpcError) as failed:
                call()
            assert failed.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert "Bearer" in failed.value.details()


def test_an_undecodable_request_without_the_token_is_unauthenticated_not_parsed(guarded):
    stack, _ = guarded
    with grpc.insecure_channel(stack.address) as channel:
        raw = channel.unary_unary(f"/{SERVICE_NAME}/Generate")
        with pytest.raises(grpc.RpcError) as failed:
            raw(b"\xff\xff\xff\xff", timeout=CALL_TIMEOUT_S)
    assert failed.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])  # the scheme's case does not matter (RFC 7235)
def test_every_coordinator_rpc_with_the_token_is_served(guarded, scheme):
    stack, _ = guarded
    with grpc.insecure_channel(stack.address) as channel:
        responses = {name: call() for name, call in _calls(channel, [("authorization", f"{scheme} {TOKEN}")]).items()}
    assert len(responses["Generate"].token_ids) == 4
    assert responses["GenerateStream"].usage.completion_tokens == 4
    assert responses["ModelInfo"].target_model == stack.target_model


def test_health_and_reflection_stay_open_without_a_token(guarded):
    stack, _ = guarded
    with grpc.insecure_channel(stack.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=CALL_TIMEOUT_S
        ))
    listed = {s.name for s in replies[0].list_services_response.service}
    assert SERVICE_NAME in listed


def _specd_generate(address: str, *flags: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specd", "generate", "--address", address, *flags,
         "--json", "--max-new-tokens", "4", "--temperature", "0", "x"],
        capture_output=True, text=True, timeout=120, env=env,
    )


def test_specd_generate_sends_the_token_from_its_file_or_env(guarded, token_file):
    stack, _ = guarded
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    from_file = _specd_generate(stack.address, "--auth-token-file", token_file, env=clean)
    assert from_file.returncode == 0, from_file.stderr
    assert len(json.loads(from_file.stdout)["token_ids"]) == 4
    from_env = _specd_generate(stack.address, env={**clean, "SPECD_AUTH_TOKEN": TOKEN})
    assert from_env.returncode == 0, from_env.stderr
    without = _specd_generate(stack.address, env=clean)
    assert without.returncode == 1 and without.stderr.startswith("UNAUTHENTICATED: ")
    assert TOKEN not in without.stderr


def test_the_token_reaches_no_log_and_no_span(guarded, caplog):
    stack, exporter = guarded
    caplog.set_level(logging.DEBUG)
    with grpc.insecure_channel(stack.address) as channel:
        for metadata in ([("authorization", f"Bearer {TOKEN}")], [("authorization", f"Bearer {TOKEN}x")]):
            for call in _calls(channel, metadata).values():
                try:
                    call()
                except grpc.RpcError as exc:
                    assert TOKEN not in exc.details()
    spans = exporter.get_finished_spans()
    assert any(span.name == "llm_request" for span in spans), "the served calls were traced"
    for span in spans:
        assert TOKEN not in span.to_json(), f"span {span.name} holds the token"
    assert caplog.records, "the coordinator logged nothing: the check below would be empty"
    for record in caplog.records:
        assert TOKEN not in record.getMessage() and TOKEN not in repr(record.__dict__)


def test_a_token_file_that_is_missing_or_empty_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="--auth-token-file .*missing.*cannot read it"):
        read_token(str(tmp_path / "missing"))
    (tmp_path / "blank").write_text(" \n")
    with pytest.raises(ConfigError, match="--auth-token-file .*blank.*no token"):
        read_token(str(tmp_path / "blank"))


def test_specd_bench_address_sends_the_token_to_that_stack(guarded, token_file, monkeypatch):
    """`specd bench --address` talks to the stack through the same channel as `specd generate`."""
    stack, _ = guarded
    for name in [n for n in os.environ if n.startswith("SPECD_")]:
        monkeypatch.delenv(name)
    argv = ["bench", "--address", stack.address, "--auth-token-file", token_file]
    stub = bench_cli._stub(stack.address, build_parser(argv).parse_args(argv))
    assert stub.ModelInfo(pb.ModelInfoRequest(), timeout=CALL_TIMEOUT_S).target_model == stack.target_model
