"""How a request's rounds run: the first draft is made while the target prefills (sd) or beside
the round-zero verify that is the prefill (ssd), every acceptance count occurs with stats that agree
with the stream, and a healthy run never resends a call."""

from __future__ import annotations

import logging
import time

import pytest

from specd.v1 import coordinator_pb2 as pb
from target_service.calls import PrefillCall, VerifyCall
from tests.conftest import (
    CALL_TIMEOUT_S,
    assert_greedy_equal_or_near_tie,
    request,
)
from tests.e2e.trio.conftest import MAX_NEW, PROMPTS, collect_stream
from tests.stack import RunnerGate, prefill_gate, verify_gate


def test_first_draft_is_made_while_the_target_prefills(stack, stub, reference, monkeypatch):
    """sd: round 0's Propose feeds the prompt to the draft and drafts while the target's
    prefill is held on its model thread; no separate draft Prefill is sent."""
    mode = pb.SPECULATION_MODE_SD
    model, _, prompts, greedy = reference
    text = PROMPTS[2]
    calls = _record_calls(monkeypatch, stack.draft.servicer.runner, ("prefill", "propose_job"))
    gate = prefill_gate(stack.target.servicer.runner)
    try:
        future = stub.Generate.future(request(prompts[text], mode=mode, max_new_tokens=MAX_NEW), timeout=CALL_TIMEOUT_S)
        first = _first_call_while_held(gate, calls, "target's prefill")
        assert first == "propose_job", f"draft calls while the target prefilled: {calls}"
    finally:
        gate.release()
    response = future.result()
    assert "prefill" not in calls
    assert response.stats.mode == mode and not response.stats.fallback_reason
    assert_greedy_equal_or_near_tie(model, prompts[text], list(response.token_ids), greedy[text])


def test_ssd_round_zero_verify_is_the_prefill_with_the_draft_speculating_beside(stack, stub, reference, monkeypatch):
    """ssd: the first Verify carries the whole prompt and no draft (no target Prefill); while
    it is held on the target's model thread the draft takes the prompt with a Speculate, not
    a Propose or a Prefill."""
    model, _, prompts, greedy = reference
    text = PROMPTS[5]
    target_runner = stack.target.servicer.runner
    calls = _record_calls(monkeypatch, stack.draft.servicer.runner, ("prefill", "propose_job", "speculate_job"))
    verifies: list[tuple[int, list[int], list[int]]] = []  # (start, tokens, draft tokens)
    target_prefills: list[PrefillCall] = []
    original_batch = target_runner.run_batch

    def recorded(batch, *args):  # the servicer hands the runner every call through run_batch
        verifies.extend((call.start, list(call.tokens), list(call.draft_tokens)) for call in batch if isinstance(call, VerifyCall))
        target_prefills.extend(call for call in batch if isinstance(call, PrefillCall))
        return original_batch(batch, *args)

    monkeypatch.setattr(target_runner, "run_batch", recorded)
    gate = verify_gate(target_runner)  # wraps the recorder, and puts it back on release
    try:
        future = stub.Generate.future(
            request(prompts[text], mode=pb.SPECULATION_MODE_SSD, max_new_tokens=MAX_NEW), timeout=CALL_TIMEOUT_S
        )
        first = _first_call_while_held(gate, calls, "first verify")
        assert first == "speculate_job", f"draft calls while the target prefilled: {calls}"
    finally:
        gate.release()
    response = future.result()
    assert verifies[0] == (0, prompts[text], [])
    assert not target_prefills and "prefill" not in calls
    assert response.stats.mode == pb.SPECULATION_MODE_SSD and not response.stats.fallback_reason
    assert response.stats.draft_tokens > 0
    assert_greedy_equal_or_near_tie(model, prompts[text], list(response.token_ids), greedy[text])


def _record_calls(monkeypatch, runner, names) -> list[str]:
    """The list that `runner`'s methods among `names` append their name to when called."""
    calls: list[str] = []
    for name in names:
        original = getattr(runner, name)
        monkeypatch.setattr(runner, name, lambda *a, _n=name, _f=original, **kw: calls.append(_n) or _f(*a, **kw))
    return calls


def _first_call_while_held(gate: RunnerGate, calls: list[str], what: str) -> str:
    """Once `gate` holds its call, the first name `calls` records ("" if none comes)."""
    assert gate.held.wait(CALL_TIMEOUT_S), f"the {what} never ran"
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    return calls[0] if calls else ""


def test_every_acceptance_count_occurs_and_stats_agree(stub, reference):
    """Per-round k from the stream (a round emits k+1 tokens); every k in 0..K occurs for K = 4."""
    _, _, prompts, _ = reference
    k_max = 4
    seen: set[int] = set()
    for text in PROMPTS:
        ids, sizes, _, messages = collect_stream(stub, request(prompts[text], k=k_max))
        stats = messages[-1].stats
        round_sizes = sizes[:-1]  # the last message carries no tokens, only the finish
        assert sizes[-1] == 0 and len(round_sizes) == stats.rounds
        ks = [size - 1 for size in round_sizes]
        # Every round but the last drafted K (only the last can be cut short by max_new_tokens).
        seen.update(ks[:-1])
        assert stats.accepted_tokens == sum(ks)
        per_position = list(stats.accepted_per_position) + [0] * (k_max - len(stats.accepted_per_position))
        assert per_position == [sum(k > j for k in ks) for j in range(k_max)]
        assert stats.mean_acceptance_length == pytest.approx(1 + sum(ks) / len(ks))
        assert stats.acceptance_rate == pytest.approx(stats.accepted_tokens / stats.draft_tokens)
        assert stats.verify_ms > 0  # the target's forwards, summed over the rounds
    assert seen == set(range(k_max + 1)), f"acceptance counts seen: {sorted(seen)}"


def test_no_session_resync_in_a_healthy_run(stub, reference, caplog):
    """With both workers up, no call should be answered NOT_FOUND/FAILED_PRECONDITION and resent."""
    _, _, prompts, _ = reference
    with caplog.at_level(logging.INFO, logger="coordinator.workers"):
        stub.Generate(request(prompts[PROMPTS[1]], max_new_tokens=16), timeout=CALL_TIMEOUT_S)
        stub.Generate(request(prompts[PROMPTS[1]], max_new_tokens=16, temperature=1.0, seed=3), timeout=CALL_TIMEOUT_S)
    resyncs = [r.getMessage() for r in caplog.records if "resending" in r.getMessage()]
    assert not resyncs, resyncs
