"""Long sequences: prompts sent to the workers in bounded calls, and requests that reach the end
of the draft's context.

A prompt of thousands of tokens on a CPU target takes longer to cache than the worker timeout
allows one call (an 8k prompt of the default target: ~60 s on one thread). The coordinator sends
a tail longer than `--worker-call-tokens` ahead as Prefill calls of that many tokens, each within
its own timeout, so the request is served, and a request that ends mid-prompt stops the prefill
at the next call. Near the end of the draft's context (the target's, or a shorter one of its
own), the draft is asked for nothing it would refuse: a refusal would take it for down.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import grpc
import pytest

from specd.v1 import coordinator_pb2 as pb
from tests.conftest import (
    CALL_TIMEOUT_S,
    assert_greedy_equal_or_near_tie,
    greedy_reference,
    load_reference,
    request,
    running_stack,
)
from tests.stack import wait_for
from tests.tracing import in_memory_tracing

CALL_TOKENS = 24
PROMPT_TOKENS = 150
SECONDS_PER_TOKEN = 0.01  # the slow target's cost of each committed token a call feeds it
WORKER_TIMEOUT_S = 1.0  # 150 tokens in one call: 1.5 s; a call of 24: 0.24 s
SHORT_DRAFT_CONTEXT = 128
MODES = {"off": pb.SPECULATION_MODE_OFF, "sd": pb.SPECULATION_MODE_SD, "ssd": pb.SPECULATION_MODE_SSD}


def _prompt(count: int) -> list[int]:
    return [5 + (i * 7) % 300 for i in range(count)]


@pytest.fixture(scope="module")
def target_model(tiny_pair):
    model, _ = load_reference(tiny_pair[0])
    return model


class CallLog:
    """The committed tokens each worker call fed: the target's batches, the draft's three calls."""

    def __init__(self, target_runner, draft_runner=None):
        self.target: list[tuple[str, int]] = []  # (call type, tokens)
        self.draft: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        run_batch = target_runner.run_batch

        def logged_batch(calls, most_tokens=None):
            with self._lock:
                self.target.extend((type(call).__name__, len(call.tokens)) for call in calls)
            return run_batch(calls, most_tokens)

        target_runner.run_batch = logged_batch
        if draft_runner is not None:
            for name in ("prefill", "propose_job", "speculate_job"):
                setattr(draft_runner, name, self._draft_logged(name, getattr(draft_runner, name)))

    def _draft_logged(self, name, method):
        def logged(session_id, start, tokens, *args, **kwargs):
            with self._lock:
                self.draft.append((name, len(tokens)))
            return method(session_id, start, tokens, *args, **kwargs)

        return logged


def slow_target(runner, seconds_per_token: float) -> None:
    """A target that takes `seconds_per_token` for each committed token a call feeds it, as a
    large one on a CPU does with a long prompt."""
    run_batch = runner.run_batch

    def slow(calls, most_tokens=None):
        time.sleep(seconds_per_token * sum(len(call.tokens) for call in calls))
        return run_batch(calls, most_tokens)

    runner.run_batch = slow


@pytest.mark.parametrize("mode", list(MODES))
def test_a_long_prompt_goes_in_calls_of_at_most_worker_call_tokens_with_the_same_output(tiny_pair, target_model, mode):
    prompt = _prompt(PROMPT_TOKENS)
    want = greedy_reference(target_model, prompt, 12)
    with running_stack(*tiny_pair, coordinator_overrides={"worker_call_tokens": CALL_TOKENS}) as stack:
        calls = CallLog(stack.target.servicer.runner, stack.draft.servicer.runner)
        response = stack.stub().Generate(request(prompt, mode=MODES[mode], max_new_tokens=12), timeout=CALL_TIMEOUT_S)
    assert_greedy_equal_or_near_tie(target_model, prompt, list(response.token_ids), want)
    assert response.stats.fallback_reason == ""
    prefills = [tokens for kind, tokens in calls.target if kind == "PrefillCall"]
    # 150 tokens, 23 cached a call (a prefill keeps its last token back): 6 calls leave <= 24.
    assert len(prefills) >= PROMPT_TOKENS // CALL_TOKENS
    assert max(tokens for _, tokens in calls.target) <= CALL_TOKENS, calls.target
    if mode != "off":
        assert [kind for kind, _ in calls.draft].count("prefill") >= PROMPT_TOKENS // CALL_TOKENS
        assert max(tokens for _, tokens in calls.draft) <= CALL_TOKENS, calls.draft


def test_a_prompt_too_long_for_one_call_within_the_worker_timeout_is_served_in_calls(tiny_pair, target_model):
    prompt = _prompt(PROMPT_TOKENS)
    want = greedy_reference(target_model, prompt, 8)
    overrides = {"worker_timeout_s": WORKER_TIMEOUT_S}
    with running_stack(*tiny_pair, coordinator_overrides={**overrides, "worker_call_tokens": 0}) as stack:
        slow_target(stack.target.servicer.runner, SECONDS_PER_TOKEN)
        with pytest.raises(grpc.RpcError) as failed:  # the whole prompt in one call outlasts its deadline
            stack.stub().Generate(request(prompt, mode=pb.SPECULATION_MODE_OFF, max_new_tokens=8), timeout=CALL_TIMEOUT_S)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    with running_stack(*tiny_pair, coordinator_overrides={**overrides, "worker_call_tokens": CALL_TOKENS}) as stack:
        slow_target(stack.target.servicer.runner, SECONDS_PER_TOKEN)
        for mode in (pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_SSD):
            response = stack.stub().Generate(request(prompt, mode=mode, max_new_tokens=8), timeout=CALL_TIMEOUT_S)
            assert_greedy_equal_or_near_tie(target_model, prompt, list(response.token_ids), want)


def test_a_request_that_ends_mid_prompt_stops_its_prefill_at_the_next_call(tiny_pair):
    prompt = _prompt(400)  # 17 calls of 24 tokens, 0.24 s each on the slow target
    with running_stack(*tiny_pair, coordinator_overrides={"worker_call_tokens": CALL_TOKENS}) as stack:
        runner = stack.target.servicer.runner
        slow_target(runner, SECONDS_PER_TOKEN)
        calls = CallLog(runner)
        with pytest.raises(grpc.RpcError) as ended:
            stack.stub().Generate(request(prompt, mode=pb.SPECULATION_MODE_OFF, max_new_tokens=8), timeout=1.0)
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_for(lambda: len(runner.sessions) == 0, 5.0)  # the request's session is ended
        sent = len(calls.target)
        time.sleep(1.0)  # the rest of the prompt would be 3 more seconds of calls
        assert len(calls.target) == sent
        assert sent < 400 // CALL_TOKENS
        response = stack.stub().Generate(request(_prompt(10), mode=pb.SPECULATION_MODE_OFF, max_new_tokens=4), timeout=5.0)
        assert len(response.token_ids) == 4


@pytest.mark.parametrize("left", [2, 3, 5, 8])
def test_ssd_near_the_context_end_builds_trees_that_fit_and_keeps_the_draft(tiny_pair, target_model, left):
    """The last rounds' Speculate asks for no more tree than the context holds: a draft that
    refused it would be taken for down, and the request would say so in fallback_reason."""
    context = target_model.config.max_position_embeddings
    prompt = _prompt(context - left)
    want = greedy_reference(target_model, prompt, left)
    with running_stack(*tiny_pair) as stack:
        response = stack.stub().Generate(
            request(prompt, mode=pb.SPECULATION_MODE_SSD, k=4, max_new_tokens=48), timeout=CALL_TIMEOUT_S
        )
        assert stack.coordinator.servicer.draft.usable()
    assert_greedy_equal_or_near_tie(target_model, prompt, list(response.token_ids), want)
    assert response.finish_reason == pb.FINISH_REASON_LENGTH
    assert response.stats.fallback_reason == ""
    assert response.stats.mode == pb.SPECULATION_MODE_SSD


@pytest.fixture(scope="module")
def short_context_draft(tiny_pair, tmp_path_factory):
    """The tiny draft, its context cut to 128 positions: shorter than the target's 512."""
    folder = tmp_path_factory.mktemp("short_draft")
    shutil.copytree(tiny_pair[1], folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = SHORT_DRAFT_CONTEXT
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_a_draft_with_a_shorter_context_stops_drafting_at_its_end_and_is_not_taken_for_down(
    tiny_pair, target_model, short_context_draft, mode
):
    prompt = _prompt(SHORT_DRAFT_CONTEXT - 30)  # the request runs 30 tokens past the draft's context
    want = greedy_reference(target_model, prompt, 60)
    with running_stack(tiny_pair[0], short_context_draft) as stack:
        response = stack.stub().Generate(request(prompt, mode=MODES[mode], k=4, max_new_tokens=60), timeout=CALL_TIMEOUT_S)
        assert stack.coordinator.servicer.draft.usable()
    assert_greedy_equal_or_near_tie(target_model, prompt, list(response.token_ids), want)
    assert response.stats.fallback_reason == ""
    assert response.stats.draft_tokens > 0  # it drafted while the draft's context had room


def test_a_long_prompts_prefill_calls_are_spans_of_ssd_round_0(tiny_pair):
    providers, exporters = in_memory_tracing()
    with running_stack(*tiny_pair, tracer_providers=providers, coordinator_overrides={"worker_call_tokens": CALL_TOKENS}) as stack:
        stack.stub().Generate(request(_prompt(PROMPT_TOKENS), mode=pb.SPECULATION_MODE_SSD, max_new_tokens=4), timeout=CALL_TIMEOUT_S)
        providers["coordinator"].force_flush()
        spans = exporters["coordinator"].get_finished_spans()
    by_id = {span.context.span_id: span for span in spans}
    (round_0,) = [s for s in spans if s.name == "spec_round" and s.attributes["specd.round.index"] == 0]
    for worker in ("TargetWorker", "DraftWorker"):
        prefills = [s for s in spans if s.name == f"/specd.v1.{worker}/Prefill"]
        assert len(prefills) >= PROMPT_TOKENS // CALL_TOKENS, worker
        assert all(by_id[s.parent.span_id] is round_0 for s in prefills), worker
