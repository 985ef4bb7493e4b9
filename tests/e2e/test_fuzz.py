"""Fuzzing (issue 20): random values for every GenerateRequest field, and random messages for
every worker RPC sent to the workers directly, against a running tiny stack. Every call ends
with a clean status (never UNKNOWN or INTERNAL, never a hang: each call has a deadline), and a
greedy request running beside the fuzzing, and one after it, decodes as it did before.

Seeded (derandomize) and bounded (max_examples): the same examples on every run.
"""

from __future__ import annotations

import collections
import threading
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, assert_greedy_equal_or_near_tie, copy_target, load_reference, request, running_stack
from tests.message_strategies import SESSION_IDS, mutations, requests

FUZZ_CALL_S = 30.0  # any call past this is a hang
GREEDY_PROMPT = [5, 17, 42, 99, 7, 3]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
# Every status a fuzzed call may end with: the request was served, or refused for a reason the
# caller can act on. UNKNOWN, INTERNAL and DEADLINE_EXCEEDED (a hang) are never among them.
GENERATE_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
WORKER_CODES = GENERATE_CODES | {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}
# The stack runs in this process: its OpenTelemetry span ids come from `random` on the stack's
# thread while hypothesis generates examples here, which hypothesis takes for a strategy's use.
pytestmark = pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
FUZZ = settings(
    derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


class GreedyBeside:
    """Greedy requests, one after another on a thread, while the fuzzing runs."""

    def __init__(self, stub):
        self._stub = stub
        self._stop = threading.Event()
        self.outputs: list[list[int]] = []
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                response = self._stub.Generate(greedy_request(), timeout=CALL_TIMEOUT_S)
                self.outputs.append(list(response.token_ids))
            except grpc.RpcError as exc:
                self.errors.append(f"{exc.code().name}: {exc.details()}")

    def __enter__(self) -> "GreedyBeside":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(CALL_TIMEOUT_S)


def greedy_request() -> pb.GenerateRequest:
    return request(GREEDY_PROMPT, mode=pb.SPECULATION_MODE_SSD, max_new_tokens=16)


def _valid_generate(input_kind: str, mode: int, temperature: float) -> pb.GenerateRequest:
    message = request(GREEDY_PROMPT, mode=mode, max_new_tokens=6, temperature=temperature, seed=3)
    if input_kind == "prompt":
        message.prompt = "def add(a, b):"
    elif input_kind == "messages":
        message.messages.messages.add(role="user", content="for i in range(10):")
    return message


VALID_GENERATE = st.builds(
    _valid_generate,
    st.sampled_from(["prompt_token_ids", "prompt", "messages"]),
    st.sampled_from(list(pb.SpeculationMode.values())),
    st.sampled_from([0.0, 0.7]),
)
# Half wholly random, half valid requests with a few fields fuzzed.
GENERATE_REQUESTS = st.one_of(requests(pb.GenerateRequest), mutations(VALID_GENERATE, pb.GenerateRequest))


@pytest.fixture(scope="module")
def fuzz_stack(tiny_pair, tmp_path_factory):
    target = copy_target(tiny_pair[0], tmp_path_factory.mktemp("chat_target"), chat_template=CHAT_TEMPLATE)
    with running_stack(target, tiny_pair[1], target_overrides=dict(verify_after_wait_s=0.2)) as stack:
        yield stack


@pytest.fixture(scope="module")
def reference(fuzz_stack):
    """The greedy request's output before any fuzzing, and the target as plain transformers runs it."""
    model, _ = load_reference(fuzz_stack.target_model)
    return list(fuzz_stack.stub().Generate(greedy_request(), timeout=CALL_TIMEOUT_S).token_ids), model


def _status(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        assert "Traceback" not in (exc.details() or ""), exc.details()
        return exc.code()
    return grpc.StatusCode.OK


def _generate(stub, message: pb.GenerateRequest, stream: bool) -> grpc.StatusCode:
    if stream:
        return _status(lambda: list(stub.GenerateStream(message, timeout=FUZZ_CALL_S)))
    return _status(lambda: stub.Generate(message, timeout=FUZZ_CALL_S))


def _check_beside(beside: GreedyBeside, reference) -> None:
    want, model = reference
    assert not beside.errors, beside.errors
    assert beside.outputs, "no greedy request completed beside the fuzzing"
    for got in beside.outputs:
        assert_greedy_equal_or_near_tie(model, GREEDY_PROMPT, got, want)


def test_generate_fuzz(fuzz_stack, reference):
    stub = fuzz_stack.stub()
    seen: collections.Counter = collections.Counter()

    @settings(FUZZ, max_examples=300)
    @given(message=GENERATE_REQUESTS, stream=st.booleans())
    def fuzz(message, stream):
        code = _generate(stub, message, stream)
        seen[code] += 1
        assert code in GENERATE_CODES, (code, message)

    with GreedyBeside(fuzz_stack.stub()) as beside:
        fuzz()
    _check_beside(beside, reference)
    # The fuzzing reached past the checks, and was refused by them.
    assert seen[grpc.StatusCode.OK] >= 5 and seen[grpc.StatusCode.INVALID_ARGUMENT] >= 5, seen


def _committed(start: int = 0, tokens=GREEDY_PROMPT) -> common_pb2.CommittedTokens:
    return common_pb2.CommittedTokens(start=start, token_ids=tokens)


SAMPLINGS = [
    common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=1),
    common_pb2.SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=2),
]
Q = [common_pb2.SparseDistribution(token_ids=[8, 9], probs=[0.75, 0.25]), common_pb2.SparseDistribution(token_ids=[9], probs=[1.0])]


def _verify(session: str, sampling: int, start: int = 0, tokens=GREEDY_PROMPT) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(
        session_id=session, committed=_committed(start, tokens), draft_tokens=[8, 9], draft_probs=Q, sampling=SAMPLINGS[sampling]
    )


def _verify_after(session: str, sampling: int) -> target_pb2.VerifyAfterRequest:
    after = len(GREEDY_PROMPT)
    choices = [target_pb2.VerifyChoice(accepted=k, next_token=t, verify=_verify(session, sampling, after, [8, 9][:k] + [t])) for k in (0, 2) for t in (10, 11)]
    return target_pb2.VerifyAfterRequest(session_id=session, after=after, choices=choices)


# Each worker method: its request class and a valid request for it, by session and sampling.
TARGET_METHODS = {
    "Prefill": (target_pb2.TargetPrefillRequest, lambda s, _: target_pb2.TargetPrefillRequest(session_id=s, committed=_committed())),
    "Verify": (target_pb2.VerifyRequest, _verify),
    "VerifyAfter": (target_pb2.VerifyAfterRequest, _verify_after),
    "EndSession": (target_pb2.TargetEndSessionRequest, lambda s, _: target_pb2.TargetEndSessionRequest(session_id=s)),
    "Info": (target_pb2.TargetInfoRequest, lambda s, _: target_pb2.TargetInfoRequest()),
}
DRAFT_METHODS = {
    "Prefill": (draft_pb2.DraftPrefillRequest, lambda s, _: draft_pb2.DraftPrefillRequest(session_id=s, committed=_committed())),
    "Propose": (draft_pb2.ProposeRequest, lambda s, i: draft_pb2.ProposeRequest(
        session_id=s, committed=_committed(), num_tokens=3, sampling=SAMPLINGS[i], saguaro=draft_pb2.SaguaroParams(c=0.5, fanout=[2, 1])
    )),
    "Speculate": (draft_pb2.SpeculateRequest, lambda s, i: draft_pb2.SpeculateRequest(
        session_id=s, committed=_committed(), draft_tokens=[8], fanout=[3, 2], num_tokens=2, sampling=SAMPLINGS[i]
    )),
    "EndSession": (draft_pb2.DraftEndSessionRequest, lambda s, _: draft_pb2.DraftEndSessionRequest(session_id=s)),
    "Info": (draft_pb2.DraftInfoRequest, lambda s, _: draft_pb2.DraftInfoRequest()),
}


def _method_messages(message_class, valid) -> st.SearchStrategy:
    """Wholly random messages, and valid ones with a few fields fuzzed."""
    bases = st.builds(valid, st.sampled_from(SESSION_IDS), st.integers(0, len(SAMPLINGS) - 1))
    return st.one_of(requests(message_class), mutations(bases, message_class))


def _worker_call(stubs: dict, role: str, method: str, message) -> grpc.StatusCode:
    call = getattr(stubs[role], method)
    if method == "Speculate":
        return _status(lambda: list(call(message, timeout=FUZZ_CALL_S)))
    return _status(lambda: call(message, timeout=FUZZ_CALL_S))


def _worker_messages() -> st.SearchStrategy:
    methods = [("target", name, *how) for name, how in TARGET_METHODS.items()]
    methods += [("draft", name, *how) for name, how in DRAFT_METHODS.items()]
    return st.one_of(*[st.tuples(st.just(role), st.just(name), _method_messages(cls, valid)) for role, name, cls, valid in methods])


def test_worker_rpc_fuzz(fuzz_stack, reference):
    channels = [grpc.insecure_channel(f"127.0.0.1:{service.port}") for service in (fuzz_stack.target, fuzz_stack.draft)]
    stubs = {"target": target_pb2_grpc.TargetWorkerStub(channels[0]), "draft": draft_pb2_grpc.DraftWorkerStub(channels[1])}
    seen: collections.Counter = collections.Counter()
    served: collections.Counter = collections.Counter()

    @settings(FUZZ, max_examples=600)
    @given(call=_worker_messages())
    def fuzz(call):
        role, method, message = call
        code = _worker_call(stubs, role, method, message)
        seen[(role, method, code)] += 1
        assert code in WORKER_CODES, (role, method, code, message)
        if code == grpc.StatusCode.OK and method in ("Prefill", "Propose", "Speculate", "Verify"):
            served[method] += 1

    try:
        with GreedyBeside(fuzz_stack.stub()) as beside:
            fuzz()
        for session_id in SESSION_IDS:  # what the fuzzing opened, closed
            stubs["target"].EndSession(target_pb2.TargetEndSessionRequest(session_id=session_id), timeout=CALL_TIMEOUT_S)
            stubs["draft"].EndSession(draft_pb2.DraftEndSessionRequest(session_id=session_id), timeout=CALL_TIMEOUT_S)
    finally:
        for channel in channels:
            channel.close()
    _check_beside(beside, reference)
    every_method = {(role, name) for role, methods in (("target", TARGET_METHODS), ("draft", DRAFT_METHODS)) for name in methods}
    assert {(role, method) for role, method, _ in seen} == every_method, seen
    assert all(served[method] for method in ("Prefill", "Propose", "Speculate", "Verify")), (served, seen)


def test_the_stack_decodes_as_before_after_the_fuzzing(fuzz_stack, reference):
    want, model = reference
    got = list(fuzz_stack.stub().Generate(greedy_request(), timeout=CALL_TIMEOUT_S).token_ids)
    assert_greedy_equal_or_near_tie(model, GREEDY_PROMPT, got, want)
    # Every request's sessions end (the coordinator ends them without waiting): none leaks.
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and (len(fuzz_stack.target.servicer.runner.sessions) or len(fuzz_stack.draft.servicer.runner.sessions)):
        time.sleep(0.05)
    assert len(fuzz_stack.target.servicer.runner.sessions) == 0
    assert len(fuzz_stack.draft.servicer.runner.sessions) == 0
