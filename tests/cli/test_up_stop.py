"""`specd up` stops in order: Ctrl-C (SIGINT to its whole process group, as a terminal sends it)
or SIGTERM to it alone stops the coordinator first, which lets a running stream finish, then the
workers; `specd up` exits 0 and removes the temporary log folder it made."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import grpc
import pytest

from specd.v1 import common_pb2, coordinator_pb2_grpc
from specd.v1 import coordinator_pb2 as pb
from tests.cli.test_up import Up

MAX_NEW = 400  # target-only, one token a round: still running when the stop comes (the tiny models' context is 512)
CALL_TIMEOUT_S = 120.0


def _long_stream(stub):
    return stub.GenerateStream(
        pb.GenerateRequest(prompt="def add(a, b):", max_new_tokens=MAX_NEW, ignore_eos=True,
                           sampling=common_pb2.SamplingParams(temperature=0.0),
                           speculation=pb.SpeculationParams(mode=pb.SPECULATION_MODE_OFF)),
        timeout=CALL_TIMEOUT_S,
    )


def _stop_up(up: Up) -> None:
    """Ends a `specd up` a failed test left running, with its services."""
    if up.process.poll() is None:
        up.process.send_signal(signal.SIGTERM)
        try:
            up.process.wait(timeout=CALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            up.process.kill()
            up.process.wait()


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_a_stop_lets_the_running_stream_finish_then_exits_0(tiny_pair, tmp_path, stop):
    target, draft = tiny_pair
    keep_logs = stop == "ctrl-c"  # with --log-dir: the coordinator's log tells that the stream ran through the stop
    up = Up(tmp_path, "--target", target, "--draft", draft, "--port", "0", "--metrics-port", "-1", log_dir=keep_logs)
    try:
        line = up.process.stdout.readline()
        assert (match := re.fullmatch(r"coordinator listening on (\S+)\n", line)), f"{line!r}: {up.stderr()}"
        with grpc.insecure_channel(match.group(1)) as channel:
            stream = _long_stream(coordinator_pb2_grpc.CoordinatorStub(channel))
            chunks = [next(stream)]
            if stop == "ctrl-c":
                os.killpg(up.process.pid, signal.SIGINT)  # its own group: the test's is left alone
            else:
                up.process.send_signal(signal.SIGTERM)
            chunks += list(stream)
        assert up.process.wait(timeout=CALL_TIMEOUT_S) == 0, up.stderr()
    finally:
        _stop_up(up)
    assert sum(len(chunk.token_ids) for chunk in chunks) == MAX_NEW
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    if keep_logs:
        log = (tmp_path / "logs" / "coordinator.log").read_text()
        assert "stopping: 1 calls running" in log, log
        assert (tmp_path / "logs" / "target.log").exists()
    else:
        made = re.search(r"logs in (\S+)", up.stderr()).group(1)
        assert made.startswith(str(tmp_path)) and not os.path.exists(made), up.stderr()
        assert not [p for p in tmp_path.glob("specd-up-*") if p.is_dir()]


def test_a_failed_start_keeps_the_log_folder_and_says_where(tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # a model folder at a glance, which the target fails to load
    up = Up(tmp_path, "--target", str(broken), "--draft", "", "--port", "0", "--metrics-port", "-1", log_dir=False)
    try:
        assert up.process.wait(timeout=CALL_TIMEOUT_S) == 1, up.stderr()
    finally:
        _stop_up(up)
    made = re.search(r"logs in (\S+)", up.stderr()).group(1)
    assert f"a service failed; its logs stay in {made}" in up.stderr(), up.stderr()
    assert os.path.isfile(os.path.join(made, "target.log"))
