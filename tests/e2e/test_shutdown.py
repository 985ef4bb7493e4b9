"""SIGTERM to a coordinator: new requests are refused at once, running ones finish within
--shutdown-grace-s, and the process exits as soon as they have.

The coordinator runs as `specd serve coordinator` in a process of its own (the signal is the
real one); its workers run in this process, the target slowed so that a request lasts seconds.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.v1 import coordinator_pb2 as pb
from specd.v1 import coordinator_pb2_grpc
from tests.conftest import CALL_TIMEOUT_S, greedy_reference, load_reference, request, running_stack
from tests.stack import slow_verify, wait_for

NEW_TOKENS = 30
VERIFY_S = 0.25  # each target step: the request lasts ~7 s after the signal, past the workers' 5 s grace
PROMPT = [5, 17, 33, 2, 90, 41]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serving(channel: grpc.Channel) -> bool:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("grace_s", [20.0, 0.0])
def test_sigterm_refuses_new_requests_and_lets_running_ones_finish_within_the_grace(tiny_pair, tmp_path, grace_s):
    model, _ = load_reference(tiny_pair[0])
    want = greedy_reference(model, PROMPT, NEW_TOKENS)
    with running_stack(*tiny_pair) as stack:
        slow_verify(stack.target.servicer.runner, VERIFY_S)
        port = _free_port()
        log = (tmp_path / "coordinator.log").open("w")
        process = subprocess.Popen(
            [sys.executable, "-m", "specd", "serve", "coordinator", "--host", "127.0.0.1", "--port", str(port),
             "--metrics-port", "-1", "--http-port", "-1", "--target-address", f"127.0.0.1:{stack.target.port}",
             "--draft-address", f"127.0.0.1:{stack.draft.port}", "--shutdown-grace-s", str(grace_s)],
            stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            assert wait_for(lambda: _serving(channel), 60.0), (tmp_path / "coordinator.log").read_text()
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            stream = stub.GenerateStream(
                request(PROMPT, mode=pb.SPECULATION_MODE_OFF, k=None, max_new_tokens=NEW_TOKENS), timeout=CALL_TIMEOUT_S
            )
            messages = [next(stream)]
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            assert wait_for(lambda: not _serving(channel), 5.0)  # NOT_SERVING, or no longer answering
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(request(PROMPT, mode=pb.SPECULATION_MODE_OFF, k=None, max_new_tokens=2), timeout=5.0)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            if grace_s:  # its port stays open while it drains, to say why
                assert "the Coordinator service is stopping" in refused.value.details(), refused.value.details()
            if grace_s == 0.0:  # the running request is cut off at once
                with pytest.raises(grpc.RpcError):
                    list(stream)
            else:
                messages.extend(stream)
                assert [t for m in messages for t in m.token_ids] == want
                assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert process.wait(timeout=15.0) == 0
            assert time.monotonic() - signalled < 15.0  # it stopped when the request ended, not at the grace's end
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
