"""Chaos: worker processes stopped (SIGSTOP) and killed (SIGKILL) in the middle of a stream.

The target and draft run as real `python -m specd serve` processes on 127.0.0.1; the coordinator
runs in-process with a short worker timeout. A hung or lost draft costs only speed: the stream
ends with the undisturbed greedy output, far inside the worker timeout, and the draft is used
again once it answers its health check. A hung or lost target is UNAVAILABLE within one worker
timeout, never two. Every check is a status within a deadline, never a measured time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.config import CoordinatorConfig
from coordinator.server import start_coordinator
from coordinator.speculation_cache import Draft
from coordinator.target_link import TargetLink, TargetUnavailable, verify_request
from coordinator.verify_ahead import SentAhead, VerifyAhead
from specd.v1 import common_pb2, coordinator_pb2_grpc, target_pb2
from specd.v1 import coordinator_pb2 as pb
from tests.conftest import assert_greedy_equal_or_near_tie, load_reference, request
from tests.request_states import request_state
from tests.stack import ServiceStack

WORKER_TIMEOUT_S = 3.0
MARGIN_S = 1.5  # what a loaded machine may add to a deadline; well below another worker timeout
MAX_NEW = 384  # long enough that a stop after the first chunk lands mid-stream
START_TIMEOUT_S = 90.0  # a worker process imports torch and loads its model
BACK_WITHIN_S = 5.0  # "within seconds": the draft's health check is asked every draft_retry_s
PROMPT = "def add(a, b):"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


# What a worker logs once its server is bound ("... started on 127.0.0.1:PORT, loading ...").
_BOUND_PORT = re.compile(r" started on [\w.]+:(\d+)")


class WorkerProcess:
    """`python -m specd serve ROLE`, importing this checkout's code, on the port it picks itself
    (a port picked here and passed on could be taken meanwhile: gRPC servers bind with
    SO_REUSEPORT, so a second one on the same port would share its connections silently)."""

    def __init__(self, role: str, model: str, log_dir: pathlib.Path):
        self.role, self.model = role, model
        self.port: int | None = None
        self._log_path = log_dir / f"{role}.log"
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        command = [
            sys.executable, "-m", "specd", "serve", self.role, "--model", self.model, "--host", "127.0.0.1",
            "--port", "0", "--metrics-port", "-1", "--device", "cpu", "--threads", "1",
        ]
        with open(self._log_path, "w") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while (bound := _BOUND_PORT.search(self._log_path.read_text())) is None:
            assert self.process.poll() is None, f"the {self.role} exited: {self._log_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"the {self.role} did not bind within {START_TIMEOUT_S} s"
            time.sleep(0.2)
        self.port = int(bound.group(1))
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                assert self.process.poll() is None, f"the {self.role} exited: {self._log_path.read_text()[-2000:]}"
                with contextlib.suppress(grpc.RpcError):
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                assert time.monotonic() < deadline, f"the {self.role} did not serve within {START_TIMEOUT_S} s"
                time.sleep(0.2)

    def signal(self, number: int) -> None:
        self.process.send_signal(number)

    def kill(self) -> None:
        """SIGKILL (after SIGCONT, so a stopped process dies too), and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(timeout=30)


class Chaos:
    """Both worker processes and the coordinator in-process, on the tiny pair."""

    def __init__(self, tiny_pair, log_dir: pathlib.Path):
        self.target = WorkerProcess("target", tiny_pair[0], log_dir)
        self.draft = WorkerProcess("draft", tiny_pair[1], log_dir)
        self._holder = ServiceStack(tiny_pair[0], None)  # only its event loop
        self.channel: grpc.Channel | None = None

    def start(self) -> None:
        for worker in (self.target, self.draft):
            worker.start()
        for worker in (self.target, self.draft):
            worker.wait_serving()
        config = CoordinatorConfig(
            host="127.0.0.1",
            port=0,
            metrics_port=-1,
            http_port=-1,
            target_address=self.target.address,
            draft_address=self.draft.address,
            worker_timeout_s=WORKER_TIMEOUT_S,
            draft_retry_s=0.2,
            startup_timeout_s=60.0,
        )
        self._holder.coordinator = self._holder.run(start_coordinator(config))
        self._holder.run(_awaited(self._holder.coordinator.ready))
        self.channel = grpc.insecure_channel(self._holder.address)

    def stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        return coordinator_pb2_grpc.CoordinatorStub(self.channel)

    def close(self) -> None:
        for worker in (self.target, self.draft):
            worker.kill()
        if self.channel is not None:
            self.channel.close()
        self._holder.close()


async def _awaited(future) -> None:
    await future


@pytest.fixture(scope="module")
def chaos(tiny_pair, tmp_path_factory):
    running = Chaos(tiny_pair, tmp_path_factory.mktemp("chaos"))
    try:
        running.start()
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def reference(tiny_pair):
    model, tokenizer = load_reference(tiny_pair[0])
    return model, tokenizer.encode(PROMPT)


def _undisturbed(chaos: Chaos, ids: list[int], mode: int) -> list[int]:
    response = chaos.stub().Generate(request(ids, mode=mode, max_new_tokens=MAX_NEW), timeout=60.0)
    assert response.stats.mode == mode and not response.stats.fallback_reason, response.stats
    return list(response.token_ids)


def _stream_with(chaos: Chaos, ids: list[int], mode: int, deadline_s: float, disturb) -> list:
    """A stream's messages, `disturb()` run once its first message is in."""
    call = chaos.stub().GenerateStream(request(ids, mode=mode, max_new_tokens=MAX_NEW), timeout=deadline_s)
    messages = [next(call)]
    disturb()
    messages.extend(call)
    return messages


def _speculates_again(chaos: Chaos, ids: list[int], mode: int) -> pb.SpeculationStats:
    """Short requests until one speculates in every round; its stats (the last, if none did)."""
    back = time.monotonic() + BACK_WITHIN_S
    while True:
        stats = chaos.stub().Generate(request(ids, mode=mode, max_new_tokens=16), timeout=30.0).stats
        if (stats.mode == mode and not stats.fallback_reason) or time.monotonic() > back:
            return stats
        time.sleep(0.1)


MODES = [pytest.param(pb.SPECULATION_MODE_SD, id="sd"), pytest.param(pb.SPECULATION_MODE_SSD, id="ssd")]


@pytest.mark.parametrize("mode", MODES)
def test_hung_draft_mid_stream_costs_no_worker_timeout_and_is_used_again_once_it_answers(chaos, reference, mode):
    model, ids = reference
    want = _undisturbed(chaos, ids, mode)
    try:
        # Far below the worker timeout per round: a round that waited for the hung draft's
        # answer would run past this deadline (DEADLINE_EXCEEDED) instead of finishing.
        messages = _stream_with(chaos, ids, mode, 2 * WORKER_TIMEOUT_S, lambda: chaos.draft.signal(signal.SIGSTOP))
    finally:
        chaos.draft.signal(signal.SIGCONT)
    final = messages[-1]
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert_greedy_equal_or_near_tie(model, ids, [t for m in messages for t in m.token_ids], want)
    assert "did not answer within" in final.stats.fallback_reason, final.stats
    stats = _speculates_again(chaos, ids, mode)
    assert stats.mode == mode and not stats.fallback_reason, f"speculation not back {BACK_WITHIN_S} s after SIGCONT: {stats}"


@pytest.mark.parametrize("mode", MODES)
def test_hung_target_mid_stream_is_unavailable_within_the_worker_timeout(chaos, reference, mode):
    model, ids = reference
    want = _undisturbed(chaos, ids, mode)
    try:
        with pytest.raises(grpc.RpcError) as raised:
            # One worker timeout and a margin: a retry with a fresh deadline would run past it.
            _stream_with(chaos, ids, mode, WORKER_TIMEOUT_S + MARGIN_S, lambda: chaos.target.signal(signal.SIGSTOP))
    finally:
        chaos.target.signal(signal.SIGCONT)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value.details()
    assert "target" in raised.value.details()
    # Going on, the target serves the same output again.
    again = chaos.stub().Generate(request(ids, mode=mode, max_new_tokens=MAX_NEW), timeout=60.0)
    assert_greedy_equal_or_near_tie(model, ids, list(again.token_ids), want)


def test_verify_sent_ahead_and_its_fallback_share_one_deadline(chaos):
    """A VerifyAfter to a hung target and the plain Verify that stands in for it fail together
    within one worker timeout (each used to get a fresh one: twice the timeout)."""

    async def answer_from_hung_target() -> None:
        link = TargetLink(chaos.target.address, WORKER_TIMEOUT_S)
        gen = request_state([5, 6, 7], k=2, max_len=32, session_id="hung-target")
        ahead = VerifyAhead(gen, link)
        tail = common_pb2.CommittedTokens(start=3, token_ids=[8])
        verify = verify_request(gen.session_id, tail, [9], [], gen.sampling, False)
        choice = target_pb2.VerifyChoice(accepted=0, next_token=8, verify=verify)
        deadline = link.deadline()
        call = asyncio.ensure_future(link.verify_after(gen.session_id, 3, [choice], deadline))
        sent = SentAhead(Draft([9], []), call, deadline)
        try:
            with pytest.raises(TargetUnavailable):
                await asyncio.wait_for(ahead.answer(sent, [5, 6, 7, 8]), WORKER_TIMEOUT_S + MARGIN_S)
        finally:
            await link.close()

    chaos.target.signal(signal.SIGSTOP)
    try:
        asyncio.run(answer_from_hung_target())
    finally:
        chaos.target.signal(signal.SIGCONT)


# The two workers are killed last, draft first: neither is restarted (each start costs a
# process's imports and model load; tests/e2e/test_failures.py covers workers coming back).


def test_killed_draft_mid_stream_keeps_the_output_exact(chaos, reference):
    model, ids = reference
    mode = pb.SPECULATION_MODE_SSD
    want = _undisturbed(chaos, ids, mode)
    messages = _stream_with(chaos, ids, mode, 2 * WORKER_TIMEOUT_S, chaos.draft.kill)
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert_greedy_equal_or_near_tie(model, ids, [t for m in messages for t in m.token_ids], want)
    assert messages[-1].stats.fallback_reason


def test_killed_target_mid_stream_is_unavailable_before_any_timeout(chaos, reference):
    _, ids = reference
    with pytest.raises(grpc.RpcError) as raised:
        # Inside one worker timeout: a killed process resets its connections, nothing waits.
        _stream_with(chaos, ids, pb.SPECULATION_MODE_AUTO, WORKER_TIMEOUT_S - 0.5, chaos.target.kill)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value.details()
    assert "target" in raised.value.details()
