"""Every bad request gets INVALID_ARGUMENT with a message naming the field to change."""

from __future__ import annotations

import grpc
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.request import MAX_STOP_BYTES, MAX_STOP_STRINGS
from coordinator.servicer import _PROMPT_THREADS
from specd.core.sampling import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, MIN_TEMPERATURE
from specd.v1 import coordinator_pb2 as pb
from specd.wire.checks import MAX_ID_BYTES
from tests.conftest import CALL_TIMEOUT_S, request, running_stack
from tests.stack import RunnerGate

VOCAB = 384  # tests/tiny_models.build_tokenizer
CONTEXT = 512  # max_position_embeddings of the tiny models
GOOD_IDS = [5, 6, 7]
MAX_PROMPT_BYTES = CoordinatorConfig.max_prompt_bytes  # the default, which the stack keeps


@pytest.fixture(scope="module")
def stack(tiny_pair):
    with running_stack(*tiny_pair) as running:
        yield running


@pytest.fixture(scope="module")
def stub(stack):
    return stack.stub()


def _set(**fields):
    def mutate(message: pb.GenerateRequest) -> None:
        for name, value in fields.items():
            setattr(message, name, value)

    return mutate


def _sampling(**fields):
    def mutate(message: pb.GenerateRequest) -> None:
        for name, value in fields.items():
            setattr(message.sampling, name, value)

    return mutate


def _speculation(**fields):
    def mutate(message: pb.GenerateRequest) -> None:
        for name, value in fields.items():
            setattr(message.speculation, name, value)

    return mutate


def _ids(ids):
    def mutate(message: pb.GenerateRequest) -> None:
        del message.prompt_token_ids.ids[:]
        message.prompt_token_ids.ids.extend(ids)

    return mutate


def _no_input(message: pb.GenerateRequest) -> None:
    message.ClearField("input")


def _empty_ids(message: pb.GenerateRequest) -> None:
    message.prompt_token_ids.SetInParent()
    del message.prompt_token_ids.ids[:]


def _messages(*pairs):
    def mutate(message: pb.GenerateRequest) -> None:
        message.messages.SetInParent()
        for role, content in pairs:
            message.messages.messages.append(pb.ChatMessage(role=role, content=content))

    return mutate


def _stop(*strings):
    def mutate(message: pb.GenerateRequest) -> None:
        message.stop.extend(strings)

    return mutate


CASES = {
    "empty prompt": (_set(prompt=""), "prompt"),
    "no input at all": (_no_input, "prompt"),
    "empty prompt_token_ids": (_empty_ids, "prompt_token_ids"),
    "empty messages": (_messages(), "messages"),
    "message without a role": (_messages(("", "hi")), "role"),
    "message with an unknown role": (_messages(("user", "hi"), ("bogus", "hi")), "role 'bogus' is not one of system, user, assistant, tool"),
    "role in capitals": (_messages(("User", "hi"),), "role 'User'"),
    "role developer": (_messages(("developer", "be brief"), ("user", "hi")), "as role system"),
    "every message's content empty": (_messages(("system", ""), ("user", "")), "content is empty"),
    "max_new_tokens 0": (_set(max_new_tokens=0), "max_new_tokens"),
    "max_new_tokens -1": (_set(max_new_tokens=-1), "max_new_tokens"),
    "max_new_tokens over the cap": (_set(max_new_tokens=4097), "max_new_tokens"),
    "temperature < 0": (_sampling(temperature=-0.5), "temperature"),
    "temperature NaN": (_sampling(temperature=float("nan")), "temperature"),
    "top_p 0": (_sampling(temperature=1.0, top_p=0.0), "top_p"),
    "top_p 1.5": (_sampling(temperature=1.0, top_p=1.5), "top_p"),
    "top_k < 0": (_sampling(temperature=1.0, top_k=-1), "top_k"),
    "negative token id": (_ids([5, -1, 6]), "prompt_token_ids"),
    "token id = vocab": (_ids([5, VOCAB]), "prompt_token_ids"),
    "token id far outside": (_ids([2**31 - 1]), "prompt_token_ids"),
    "prompt longer than the context": (_ids([5] * (CONTEXT + 88)), "prompt"),
    "prompt exactly the context": (_ids([5] * CONTEXT), "prompt"),
    "num_speculative_tokens 0": (_speculation(num_speculative_tokens=0), "num_speculative_tokens"),
    "num_speculative_tokens 33": (_speculation(num_speculative_tokens=33), "num_speculative_tokens"),
    "unknown speculation mode": (_speculation(mode=7), "speculation.mode"),
    "empty stop string": (_stop("ok", ""), "stop"),
    # Sampling values no sampler can take (issue 20: 1e-38 made the probabilities NaN).
    "temperature inf": (_sampling(temperature=float("inf")), "temperature"),
    "temperature -inf": (_sampling(temperature=float("-inf")), "temperature"),
    "temperature 1e-38": (_sampling(temperature=1e-38), "temperature"),
    "temperature just under the minimum": (_sampling(temperature=MIN_TEMPERATURE / 2), "temperature"),
    "top_p NaN": (_sampling(temperature=1.0, top_p=float("nan")), "top_p"),
    "top_p inf": (_sampling(temperature=1.0, top_p=float("inf")), "top_p"),
    "repetition_penalty 0": (_sampling(repetition_penalty=0.0), "repetition_penalty"),
    "repetition_penalty < 0": (_sampling(temperature=1.0, repetition_penalty=-1.2), "repetition_penalty"),
    "repetition_penalty NaN": (_sampling(repetition_penalty=float("nan")), "repetition_penalty"),
    "repetition_penalty inf": (_sampling(repetition_penalty=float("inf")), "repetition_penalty"),
    "repetition_penalty 1e-38": (_sampling(temperature=0.5, repetition_penalty=1e-38), "repetition_penalty"),
    "repetition_penalty just under the minimum": (_sampling(repetition_penalty=MIN_REPETITION_PENALTY / 2), "repetition_penalty"),
    "repetition_penalty over the maximum": (_sampling(repetition_penalty=MAX_REPETITION_PENALTY * 2), "repetition_penalty"),
    # Sizes checked before any work is done for them.
    "request_id of 1 MiB": (_set(request_id="r" * (1 << 20)), "request_id"),
    "request_id one byte too long": (_set(request_id="é" * (MAX_ID_BYTES // 2) + "x"), "request_id"),
    "prompt over max_prompt_bytes": (_set(prompt="a" * (MAX_PROMPT_BYTES + 1)), "prompt"),
    "prompt over max_prompt_bytes in UTF-8": (_set(prompt="é" * (MAX_PROMPT_BYTES // 2 + 1)), "prompt"),
    "messages over max_prompt_bytes": (_messages(("user", "a" * (MAX_PROMPT_BYTES // 2)), ("user", "b" * (MAX_PROMPT_BYTES // 2))), "messages"),
    "too many stop strings": (_stop(*[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), "stop"),
    "stop string too long": (_stop("x" * (MAX_STOP_BYTES + 1)), "stop"),
}


def _good() -> pb.GenerateRequest:
    return request(GOOD_IDS, max_new_tokens=4)


def test_the_base_request_is_good(stub):
    response = stub.Generate(_good(), timeout=CALL_TIMEOUT_S)
    assert len(response.token_ids) == 4


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_invalid_argument(stub, name):
    mutate, field = CASES[name]
    message = _good()
    mutate(message)
    for call in (stub.Generate, lambda m, timeout: list(stub.GenerateStream(m, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as raised:
            call(message, timeout=CALL_TIMEOUT_S)
        error = raised.value
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, error.code(), error.details())
        assert field in error.details(), (name, error.details())
        assert "Traceback" not in error.details()
        assert len(error.details()) < 1000, (name, "the details echo the request")


def test_prompt_near_the_context_stops_at_the_context(stub):
    """A prompt that fits but leaves less room than max_new_tokens finishes LENGTH at the context."""
    for prompt_len in (CONTEXT - 5, CONTEXT - 1):
        response = stub.Generate(request([5] * prompt_len, max_new_tokens=48, k=8), timeout=CALL_TIMEOUT_S)
        assert response.finish_reason == pb.FINISH_REASON_LENGTH
        assert response.usage.prompt_tokens == prompt_len
        assert response.usage.completion_tokens == CONTEXT - prompt_len
        assert response.usage.total_tokens == CONTEXT


def test_prompt_limits_name_the_limit(stub):
    """Over --max-prompt-bytes the answer names the field, the size sent and the limit."""
    for mutate, field in ((_set(prompt="a" * (MAX_PROMPT_BYTES + 1)), "prompt"),
                          (_messages(("user", "a" * MAX_PROMPT_BYTES)), "messages")):
        message = _good()
        mutate(message)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Generate(message, timeout=CALL_TIMEOUT_S)
        details = raised.value.details()
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith(field) and str(MAX_PROMPT_BYTES) in details and "--max-prompt-bytes" in details, details


def test_sampling_at_the_limits_is_served(stub):
    """The documented minimum temperature (sent as a float32) and a huge finite one both serve,
    and so do the repetition penalty's bounds."""
    for temperature in (MIN_TEMPERATURE, 3.0e38):
        response = stub.Generate(request(GOOD_IDS, max_new_tokens=4, temperature=temperature, seed=7), timeout=CALL_TIMEOUT_S)
        assert len(response.token_ids) == 4 and all(0 <= t < VOCAB for t in response.token_ids)
    for penalty in (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY):  # at the least temperature
        message = request(GOOD_IDS * 2, max_new_tokens=4, temperature=MIN_TEMPERATURE, seed=7)
        message.sampling.repetition_penalty = penalty
        response = stub.Generate(message, timeout=CALL_TIMEOUT_S)
        assert len(response.token_ids) == 4 and all(0 <= t < VOCAB for t in response.token_ids)


def test_a_request_id_at_the_limit_is_echoed(stub):
    request_id = "r" * MAX_ID_BYTES
    response = stub.Generate(request(GOOD_IDS, max_new_tokens=2, request_id=request_id), timeout=CALL_TIMEOUT_S)
    assert response.request_id == request_id


def test_a_prompt_being_tokenised_delays_no_other_request(stack, stub):
    """While large allowed prompts' tokenising is held mid-way (on their threads), more of them
    than there are prompt threads, a small request completes: tokenising never holds the event
    loop, and large prompts queue apart from small ones. Held on the loop, or queued ahead of
    it, the small request would miss its deadline."""
    tokenizer = stack.coordinator.servicer.facts.tokenizer
    gate = RunnerGate(tokenizer, "encode")
    large = request(prompt="def add(a, b):\n" * 20_000, max_new_tokens=4)
    bigs = [stub.Generate.future(large, timeout=CALL_TIMEOUT_S) for _ in range(_PROMPT_THREADS + 1)]
    try:
        assert gate.held.wait(CALL_TIMEOUT_S), "no large prompt reached the tokenizer"
        small = stub.Generate(request(GOOD_IDS, max_new_tokens=4), timeout=20.0)
        assert len(small.token_ids) == 4
        assert not any(big.done() for big in bigs)
    finally:
        gate.release()
    for big in bigs:
        with pytest.raises(grpc.RpcError) as raised:
            big.result(timeout=CALL_TIMEOUT_S)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # tokenised: far more tokens than the context
        assert "context length" in raised.value.details()
