"""What a response carries: a stream equal to the unary answer, text cut at a stop string, the
request id echoed, and the model information the coordinator reports."""

from __future__ import annotations

import pytest

from coordinator.profiles import CPU
from specd.v1 import coordinator_pb2 as pb
from tests.conftest import (
    CALL_TIMEOUT_S,
    request,
)
from tests.e2e.trio.conftest import MAX_NEW, PROMPTS, collect_stream


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_OFF], ids=["sd", "off"])
def test_stream_equals_unary(stub, reference, mode):
    _, _, prompts, _ = reference
    for text, temperature in ((PROMPTS[2], 0.0), (PROMPTS[3], 1.0)):
        message = request(prompts[text], mode=mode, temperature=temperature, seed=11, return_logprobs=True)
        unary = stub.Generate(message, timeout=CALL_TIMEOUT_S)
        ids, _, streamed_text, messages = collect_stream(stub, message)
        assert ids == list(unary.token_ids)
        assert streamed_text == unary.text
        assert [lp for m in messages for lp in m.logprobs] == pytest.approx(list(unary.logprobs), abs=1e-6)
        last = messages[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.usage == unary.usage
        assert last.stats.rounds == unary.stats.rounds and last.stats.seed == 11
        assert last.stats.mode == mode
        assert all(not m.HasField("stats") for m in messages[:-1])


def test_stop_string_cuts_the_text(stub, reference):
    _, tokenizer, prompts, _ = reference
    ids = prompts[PROMPTS[0]]
    full = stub.Generate(request(ids, max_new_tokens=MAX_NEW), timeout=CALL_TIMEOUT_S)
    text = full.text
    assert len(text) > 20
    stop = text[12:15]
    cut = text.find(stop)
    # The tokens up to the one that completes the stop string; none after it (the rounds that
    # ran ahead of the text are cut back), whichever round it came in.
    through_stop = next(
        n for n in range(1, len(full.token_ids) + 1) if stop in tokenizer.decode(full.token_ids[:n], skip_special_tokens=True)
    )
    for mode in (pb.SPECULATION_MODE_SSD, pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_OFF):
        response = stub.Generate(request(ids, mode=mode, max_new_tokens=MAX_NEW, stop=["never-there", stop]), timeout=CALL_TIMEOUT_S)
        assert response.finish_reason == pb.FINISH_REASON_STOP
        assert response.stop_reason == stop
        assert response.text == text[:cut]
        assert list(response.token_ids) == list(full.token_ids)[:through_stop]
        assert response.usage.completion_tokens == through_stop
        streamed_ids, _, streamed_text, messages = collect_stream(stub, request(ids, mode=mode, max_new_tokens=MAX_NEW, stop=[stop]))
        assert streamed_text == text[:cut] and streamed_ids == list(response.token_ids)
        assert messages[-1].finish_reason == pb.FINISH_REASON_STOP


def test_model_info(stub, reference):
    _, tokenizer, _, _ = reference
    info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert info.vocab_size == len(tokenizer)
    assert info.context_length == 512
    assert info.draft_available and info.draft_model
    assert info.target_model
    assert info.max_new_tokens_limit == 4096
    assert info.default_num_speculative_tokens == CPU.num_speculative_tokens == 3  # the target runs on a CPU


def test_request_id_is_echoed(stub, reference):
    _, _, prompts, _ = reference
    response = stub.Generate(request(prompts[PROMPTS[0]], max_new_tokens=4, request_id="abc-123"), timeout=CALL_TIMEOUT_S)
    assert response.request_id == "abc-123"
    assert all(m.request_id == "abc-123" for m in collect_stream(stub, request(prompts[PROMPTS[0]], max_new_tokens=4, request_id="abc-123"))[3])
