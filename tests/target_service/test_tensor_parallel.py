"""The tensor-parallel target (2 ranks, gloo, CPU) against the single-process target.

- Runner level: two ranks spawned here run TensorParallelTargetRunner (rank 0) and `follow`
  (rank 1) through prefill, verify with rejections (rollback), expiry and re-prefill; every
  forward's logits are recorded on both ranks and compared with a single-process
  TargetModelRunner given the same calls, and both ranks' session stores must end identical.
  The job's collective timeout is 1.5 s and the script idles 2 s (heartbeats keep rank 1 up);
  then rank 0 falls silent and rank 1 must fail instead of hanging.
- Served: the real `specd serve target --tensor-parallel 2` as a subprocess, behind a coordinator,
  compared with the single-device stack: Verify logprobs, greedy Generate (off and sd), an idle
  period longer than the command group's collective timeout, and a killed rank 1.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.config import CoordinatorConfig
from coordinator.server import start_coordinator
from specd.core.sampling import SamplingSettings, SparseDist
from specd.engine.batcher import AGAIN
from specd.v1 import common_pb2, coordinator_pb2_grpc, target_pb2, target_pb2_grpc
from specd.v1 import coordinator_pb2 as pb
from target_service.calls import PrefillCall, VerifyCall
from target_service.config import TargetConfig
from tests.conftest import CALL_TIMEOUT_S, assert_greedy_equal_or_near_tie, load_reference, request
from tests.runner_calls import target_prefill, target_verify
from tests.stack import ServiceStack

RTOL = 1e-4  # logits: max |tp - single| <= RTOL * max |single|, per forward
PREFILL_CHUNK = 4  # the runner script's long prompt is cached this many tokens per shared forward
TP_TIMEOUT_S = 3.0  # the served job's collective timeout (command group): the idle test outwaits it
PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3], [200, 150, 100, 50, 25, 12, 6, 3]]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------- runner level, two spawned ranks


RUNNER_TP_TIMEOUT_S = 1.5  # the spawned job's collective timeout: the script idles longer than this


def _runner_script(runner) -> None:
    """The same calls on any runner: prefill, verifies that reject (rollback), expiry, re-prefill."""
    greedy = SamplingSettings(temperature=0.0)
    prompt = [5, 17, 42, 99, 7, 3, 11]
    target_prefill(runner, "a", 0, prompt)
    # A draft of tokens the target surely rejects at position 2: the cache rolls back to prompt + 2.
    first = target_verify(runner, "a", 0, prompt, [8, 9, 10, 11], [], greedy, True)
    committed = prompt + [8, 9, 10, 11][: first.accepted] + [first.next_token]
    second = target_verify(runner, "a", len(prompt), committed[len(prompt):], [1, 2, 3], [], greedy, True)
    committed += [1, 2, 3][: second.accepted] + [second.next_token]
    # Sampled: the draft distributions and settings travel to rank 1 too; keyed uniforms agree.
    sampled = SamplingSettings(temperature=0.9, top_k=50, top_p=0.95, seed=11)
    dists = [SparseDist([1, 2, 3], [0.5, 0.3, 0.2]), SparseDist([4, 5], [0.6, 0.4])]
    third = target_verify(runner, "a", len(committed) - 1, committed[-1:], [2, 5], dists, sampled, True)
    committed += [2, 5][: third.accepted] + [third.next_token]
    target_verify(runner, "a", 0, committed[:4], [6, 6], [], greedy, False)  # the coordinator resends a shorter history
    target_prefill(runner, "b", 0, [4, 4, 4, 4])
    time.sleep(2.0)  # both sessions idle past the 1 s session timeout, and past the collective timeout ...
    target_prefill(runner, "c", 0, [9, 8, 7, 6, 5])  # ... then "c" comes: only "a" and "b" expire
    assert sorted(runner.expire_idle()) == ["a", "b"]
    target_prefill(runner, "a", 0, committed)  # a fresh "a" on every rank
    last = target_verify(runner, "a", len(committed) - 1, committed[-1:], [2, 2, 2], [], greedy, True)
    committed += [2, 2, 2][: last.accepted] + [last.next_token]
    # Two verifies and a prefill of three sessions in one packed forward, on every rank alike
    # (the sessions' cached tokens, compared below, follow each verify's outcome).
    batch = runner.run_batch([
        VerifyCall("a", len(committed) - 1, committed[-1:], [7, 7], [], greedy, True),
        PrefillCall("d", 0, [3, 1, 4, 1, 5]),
        VerifyCall("c", 0, [9, 8, 7, 6, 5], [1], [], greedy, False),
    ])
    assert not any(isinstance(outcome, BaseException) for outcome in batch), batch
    assert runner.end_session("c")
    committed += [7, 7][: batch[0].accepted] + [batch[0].next_token]
    # A prompt longer than a chunk beside a session's step: cached PREFILL_CHUNK tokens per shared
    # forward (AGAIN) on every rank alike, until the rest fits.
    chunks = 0
    while True:
        long, step = runner.run_batch([
            PrefillCall("e", 0, list(range(20, 33))),  # 12 tokens to cache: 4, 4, then the last 4
            VerifyCall("a", len(committed) - 1, committed[-1:], [7], [], greedy, False),
        ])
        committed += [7][: step.accepted] + [step.next_token]
        if long is not AGAIN:
            break
        chunks += 1
    assert chunks == 2 and long[0] == 12, (chunks, long)
    # Alone, under rank 0's limit on the tokens a forward feeds (its time budget): every rank
    # cuts the prompt alike, 16 tokens a forward until the rest fits.
    chunks = 0
    while (lone := runner.run_batch([PrefillCall("f", 0, list(range(40, 80)))], 16)[0]) is AGAIN:
        chunks += 1
    assert chunks == 2 and lone[0] == 39, (chunks, lone)


def _rank_main(rank: int, world: int, model: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import specd.engine.forward
    import target_service.runner as runner_module
    from target_service import tp_follower, tp_job, tp_rank0

    recorded: list[torch.Tensor] = []
    forward = runner_module.forward_logits

    def recording_forward(*args, **kwargs):
        logits, ms = forward(*args, **kwargs)
        recorded.append(logits.clone())
        return logits, ms

    # The runner calls its module's name; specd.engine.forward's own is patched too, for anything else.
    runner_module.forward_logits = specd.engine.forward.forward_logits = recording_forward
    config = TargetConfig(model=model, device="cpu", threads=1, tensor_parallel=world, session_idle_timeout_s=1.0,
                          tp_timeout_s=RUNNER_TP_TIMEOUT_S, tp_heartbeat_s=0.2, prefill_chunk_tokens=PREFILL_CHUNK)
    job = tp_job.Job(rank=rank, world_size=world, local_rank=rank)
    if rank == 0:
        runner = tp_rank0.load_tensor_parallel_runner(config, job)
        _runner_script(runner)
        # Then rank 0 falls silent (no heartbeat, no shutdown): rank 1 must give up, not hang.
        runner._closed = True
        time.sleep(RUNNER_TP_TIMEOUT_S + 1.0)
        outcome = "rank 0 went silent"
        sessions, model = runner.sessions, runner.loaded.model
    else:
        captured = {}
        original = tp_follower.load_local_runner

        def keep(config, job):
            captured["runner"] = original(config, job)
            return captured["runner"]

        tp_follower.load_local_runner = keep
        try:
            tp_follower.follow(config, job)
            outcome = "followed to a shutdown"
        except tp_job.RankFailure as exc:
            outcome = str(exc)
        sessions, model = captured["runner"].sessions, captured["runner"].loaded.model
    state = {sid: list(s.cached_tokens) for sid, s in sessions._sessions.items()}
    attention = model.model.layers[0].self_attn
    shards = {name: tuple(getattr(attention, name).weight.to_local().shape) for name in ("q_proj", "k_proj", "o_proj")}
    result = {"logits": recorded, "sessions": state, "shards": shards, "outcome": outcome}
    torch.save(result, pathlib.Path(out_dir) / f"rank{rank}.pt")


def test_runner_logits_and_sessions_match_single_process(tiny_pair, tmp_path, monkeypatch, tp_server):
    """(tp_server is only started here, so that it loads while this test runs.)"""
    import torch.multiprocessing as mp

    import specd.engine.forward
    import target_service.runner as runner_module
    from target_service.server import load_runner

    target, _ = tiny_pair
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    # forkserver: the two ranks fork from one clean process that imported transformers once.
    mp.get_context("forkserver").set_forkserver_preload(["target_service.tensor_parallel", "transformers.modeling_utils",
                                                         "transformers.models.llama.modeling_llama", __name__])
    context = mp.start_processes(_rank_main, args=(2, target, str(tmp_path)), nprocs=2, join=False,
                                 start_method="forkserver")

    # Meanwhile, the single-process target through the same calls.
    single_logits: list[torch.Tensor] = []
    forward = runner_module.forward_logits

    def recording_forward(*args, **kwargs):
        logits, ms = forward(*args, **kwargs)
        single_logits.append(logits.clone())
        return logits, ms

    single = load_runner(TargetConfig(model=target, device="cpu", threads=1, session_idle_timeout_s=1.0,
                                      prefill_chunk_tokens=PREFILL_CHUNK))
    monkeypatch.setattr(runner_module, "forward_logits", recording_forward)
    monkeypatch.setattr(specd.engine.forward, "forward_logits", recording_forward)
    _runner_script(single)
    single_sessions = {sid: list(s.cached_tokens) for sid, s in single.sessions._sessions.items()}

    deadline = time.monotonic() + 120
    while not context.join(timeout=1):
        assert time.monotonic() < deadline, "the two ranks did not finish"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert len(single_logits) == 12  # the script's forwards: 9, then the lone prompt's 3 cut ones
    # Heartbeats kept rank 1 through the 2 s idle; once they stopped it timed out (1.5 s) and failed.
    assert "rank 0 is gone or silent" in ranks[1]["outcome"] and "Timed out" in ranks[1]["outcome"], ranks[1]["outcome"]
    for rank, result in enumerate(ranks):
        # hidden 64, 4 heads of 16, 2 KV heads: each rank holds half the heads (q, k colwise; o rowwise)
        assert result["shards"] == {"q_proj": (32, 64), "k_proj": (16, 64), "o_proj": (64, 32)}, result["shards"]
        assert result["sessions"] == single_sessions, f"rank {rank}'s sessions differ from the single process's"
        assert len(result["logits"]) == len(single_logits)
        for i, (got, want) in enumerate(zip(result["logits"], single_logits)):
            assert got.shape == want.shape
            err = float((got - want).abs().max())
            assert err <= RTOL * float(want.abs().max()), f"rank {rank}, forward {i}: max |diff| {err:.3g}"


class _BatchFailingHere:
    """A rank's local runner whose run_batch hands back each call's error, as TargetModelRunner's does."""

    def __init__(self, error: Exception):
        self.error = error

    def run_batch(self, calls, most_tokens=None):
        return [self.error for _ in calls]


def test_a_forward_that_failed_on_rank_0_alone_takes_the_job_down(monkeypatch):
    """A forward error on rank 0 only (memory, a collective) left its session reset there and not
    on the other ranks: the job goes down, the caller gets UNAVAILABLE. A request error, raised
    alike on every rank, stays the call's own."""
    from specd.core.errors import InvalidRequest
    from specd.serving.status import Unavailable
    from target_service.tp_job import Job
    from target_service.tp_rank0 import TensorParallelTargetRunner

    job = Job(rank=0, world_size=2, local_rank=0)
    runner = TensorParallelTargetRunner(_BatchFailingHere(RuntimeError("out of memory")), job, heartbeat_s=3600.0)
    monkeypatch.setattr(runner, "_send", lambda name, args: None)  # the broadcast to the other ranks
    with pytest.raises(Unavailable):
        runner.run_batch(["a call"])
    assert job.failed.is_set() and "out of memory" in job.failure

    calm = Job(rank=0, world_size=2, local_rank=0)
    refused = InvalidRequest("draft_tokens out of range")
    runner = TensorParallelTargetRunner(_BatchFailingHere(refused), calm, heartbeat_s=3600.0)
    monkeypatch.setattr(runner, "_send", lambda name, args: None)
    assert runner.run_batch(["a call"]) == [refused] and not calm.failed.is_set()


def test_a_forward_that_failed_on_a_follower_alone_takes_it_down(monkeypatch):
    from target_service import tp_follower
    from target_service.tp_job import Job, RankFailure

    def broadcast(box, src, group):
        box[0] = ("run_batch", (["a call"], None))

    monkeypatch.setattr(tp_follower, "load_local_runner", lambda config, job: _BatchFailingHere(RuntimeError("out of memory")))
    monkeypatch.setattr(tp_follower.dist, "broadcast_object_list", broadcast)
    with pytest.raises(RankFailure, match="out of memory"):
        tp_follower.follow(TargetConfig(), Job(rank=1, world_size=2, local_rank=1))


def test_settings_are_checked(monkeypatch):
    import asyncio

    from specd.core.config import ConfigError
    from target_service import tensor_parallel

    with pytest.raises(ConfigError, match="tp-heartbeat-s"):
        TargetConfig(tensor_parallel=2, tp_timeout_s=5, tp_heartbeat_s=5).validate()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="WORLD_SIZE=3 but --tensor-parallel 2"):
        asyncio.run(tensor_parallel.serve(TargetConfig(tensor_parallel=2)))


# ---------------------------------------------------------------- served: specd serve target --tensor-parallel 2


@dataclasses.dataclass
class TpServer:
    process: subprocess.Popen
    port: int
    log_path: pathlib.Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self):
        with grpc.insecure_channel(self.address) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status

    def wait_serving(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, f"the TP target exited with {self.process.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"the TP target did not start serving:\n{self.log()}"
            try:
                if self.health() == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)

    def rank_pid(self, rank: int) -> int:
        found = re.findall(rf"launched tensor-parallel rank {rank} as process (\d+)", self.log())
        assert found, self.log()
        return int(found[0])


@pytest.fixture(scope="module")
def tp_server(tiny_pair, tmp_path_factory):
    target, _ = tiny_pair
    port = _free_port()
    log_path = tmp_path_factory.mktemp("tp") / "target.log"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    command = [sys.executable, "-m", "specd", "serve", "target", "--model", target, "--host", "127.0.0.1",
               "--port", str(port), "--metrics-port", "-1", "--device", "cpu", "--threads", "1",
               "--tensor-parallel", "2", "--tp-timeout-s", str(TP_TIMEOUT_S), "--tp-heartbeat-s", "0.5"]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    yield TpServer(process, port, log_path)  # still loading: `stacks` waits for it
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="module")
def stacks(tiny_pair, tp_server):
    """The single-device stack, plus a second coordinator on the TP target and the same draft."""
    target, draft = tiny_pair
    stack = ServiceStack(target, draft).start()
    tp_server.wait_serving()

    async def tp_coordinator():
        config = CoordinatorConfig(host="127.0.0.1", port=0, metrics_port=-1, http_port=-1, target_address=tp_server.address,
                                   draft_address=f"127.0.0.1:{stack.draft.port}", draft_retry_s=0.2,
                                   worker_timeout_s=10.0)
        service = await start_coordinator(config)
        await service.ready
        return service

    coordinator = stack.run(tp_coordinator())
    channel = grpc.insecure_channel(f"127.0.0.1:{coordinator.port}")
    yield stack, coordinator_pb2_grpc.CoordinatorStub(channel), stack.stub()
    channel.close()
    try:
        stack.run(coordinator.stop(0), timeout=10)
    finally:
        stack.close()


def _verify(stub, session, start, tokens, drafts):
    return stub.Verify(
        target_pb2.VerifyRequest(
            session_id=session,
            committed=common_pb2.CommittedTokens(start=start, token_ids=tokens),
            draft_tokens=drafts,
            sampling=common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=0),
            return_logprobs=True,
        ),
        timeout=CALL_TIMEOUT_S,
    )


def test_served_verify_equals_single_device(stacks, tp_server):
    stack, _, _ = stacks
    tp_stub = target_pb2_grpc.TargetWorkerStub(grpc.insecure_channel(tp_server.address))
    single_stub = target_pb2_grpc.TargetWorkerStub(grpc.insecure_channel(f"127.0.0.1:{stack.target.port}"))
    info = tp_stub.Info(target_pb2.TargetInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert info.tensor_parallel == 2
    prompt = [5, 17, 42, 99, 7, 3]
    outcomes = []
    for stub in (tp_stub, single_stub):
        stub.Prefill(target_pb2.TargetPrefillRequest(
            session_id="v", committed=common_pb2.CommittedTokens(start=0, token_ids=prompt)), timeout=CALL_TIMEOUT_S)
        first = _verify(stub, "v", 0, prompt, [8, 9, 10, 11])  # rejected early: rollback
        tail = [8, 9, 10, 11][: first.accepted] + [first.next_token]
        second = _verify(stub, "v", len(prompt), tail, [1, 2])  # continues the cropped cache
        outcomes.append((first, second))
        stub.EndSession(target_pb2.TargetEndSessionRequest(session_id="v"), timeout=CALL_TIMEOUT_S)
    for got, want in zip(*outcomes):
        assert (got.accepted, got.next_token, got.cached_tokens) == (want.accepted, want.next_token, want.cached_tokens)
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=RTOL, atol=0)


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_SD])
def test_greedy_generate_equals_single_device(stacks, tiny_pair, mode):
    _, tp_stub, single_stub = stacks
    model, _ = load_reference(tiny_pair[0])
    rejected = 0
    for prompt in PROMPTS:
        got = tp_stub.Generate(request(prompt, mode=mode, max_new_tokens=32), timeout=CALL_TIMEOUT_S)
        want = single_stub.Generate(request(prompt, mode=mode, max_new_tokens=32), timeout=CALL_TIMEOUT_S)
        assert got.stats.mode == mode
        assert_greedy_equal_or_near_tie(model, prompt, list(got.token_ids), list(want.token_ids))
        rejected += got.stats.draft_tokens - got.stats.accepted_tokens
    if mode == pb.SPECULATION_MODE_SD:
        assert rejected > 0, "no draft token was rejected: the rollback path across ranks went untested"


def test_seeded_sampling_equals_single_device(stacks):
    """Keyed randomness: a seeded sd request draws the same tokens on the TP target as on one device."""
    _, tp_stub, single_stub = stacks
    for prompt in PROMPTS[:2]:
        message = request(prompt, mode=pb.SPECULATION_MODE_SD, max_new_tokens=24, temperature=0.9, seed=1234)
        got = tp_stub.Generate(message, timeout=CALL_TIMEOUT_S)
        want = single_stub.Generate(message, timeout=CALL_TIMEOUT_S)
        assert list(got.token_ids) == list(want.token_ids)


def test_idle_longer_than_collective_timeout(stacks, tp_server):
    _, tp_stub, _ = stacks
    time.sleep(TP_TIMEOUT_S + 2.0)  # rank 1 waits in a broadcast all along: heartbeats keep it alive
    assert tp_server.process.poll() is None, tp_server.log()
    reply = tp_stub.Generate(request(PROMPTS[0], mode=pb.SPECULATION_MODE_SD, max_new_tokens=8), timeout=CALL_TIMEOUT_S)
    assert len(reply.token_ids) == 8
    assert tp_server.health() == health_pb2.HealthCheckResponse.SERVING


def test_killed_rank_takes_the_worker_down(stacks, tp_server):
    """Last: it ends the module's TP server."""
    _, tp_stub, _ = stacks
    os.kill(tp_server.rank_pid(1), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while tp_server.health() != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, f"still SERVING after rank 1 died:\n{tp_server.log()}"
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as caught:  # refused at once: a hang ends DEADLINE_EXCEEDED
        tp_stub.Generate(request(PROMPTS[0], mode=pb.SPECULATION_MODE_OFF, max_new_tokens=8), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
    assert tp_server.process.wait(timeout=15) != 0
