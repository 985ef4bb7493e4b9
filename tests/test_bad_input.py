"""Every bad request gets INVALID_ARGUMENT with a message naming the field to change."""

from __future__ import annotations

import grpc
import pytest

from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, request, running_stack

VOCAB = 384  # tests/tiny_models.build_tokenizer
CONTEXT = 512  # max_position_embeddings of the tiny models
GOOD_IDS = [5, 6, 7]


@pytest.fixture(scope="module")
def stub(tiny_pair):
    with running_stack(*tiny_pair) as running:
        yield running.stub()


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


def test_prompt_near_the_context_stops_at_the_context(stub):
    """A prompt that fits but leaves less room than max_new_tokens finishes LENGTH at the context."""
    for prompt_len in (CONTEXT - 5, CONTEXT - 1):
        response = stub.Generate(request([5] * prompt_len, max_new_tokens=48, k=8), timeout=CALL_TIMEOUT_S)
        assert response.finish_reason == pb.FINISH_REASON_LENGTH
        assert response.usage.prompt_tokens == prompt_len
        assert response.usage.completion_tokens == CONTEXT - prompt_len
        assert response.usage.total_tokens == CONTEXT
