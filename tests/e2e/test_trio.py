"""End to end over real gRPC: coordinator, target worker and draft worker with tiny models."""

from __future__ import annotations

import concurrent.futures
import logging
import time

import pytest
import torch

from coordinator.profiles import CPU
from specd.v1 import coordinator_pb2 as pb
from target_service.runner import PrefillCall, VerifyCall
from tests.conftest import (
    CALL_TIMEOUT_S,
    assert_greedy_equal_or_near_tie,
    copy_target,
    full_logits,
    greedy_reference,
    load_reference,
    request,
    running_stack,
)
from tests.stack import RunnerGate, prefill_gate, verify_gate

MAX_NEW = 48
PROMPTS = [
    "def add(a, b):",
    "for i in range(10):\n",
    "class Point:\n    def",
    "The quick brown fox",
    "import os\nimport sys\n",
    "while True:\n    line =",
    "x = 1\ny = 2\nprint(x +",
    "Speculative decoding keeps",
]


@pytest.fixture(scope="module")
def stack(tiny_pair):
    with running_stack(*tiny_pair) as running:
        yield running


@pytest.fixture(scope="module")
def stub(stack):
    return stack.stub()


@pytest.fixture(scope="module")
def reference(tiny_pair):
    """The target in plain transformers, its tokenizer, and greedy references per prompt."""
    model, tokenizer = load_reference(tiny_pair[0])
    prompts = {text: tokenizer.encode(text, add_special_tokens=True) for text in PROMPTS}
    greedy = {text: greedy_reference(model, ids, MAX_NEW) for text, ids in prompts.items()}
    return model, tokenizer, prompts, greedy


def _stream(stub, message) -> tuple[list[int], list[int], str, list[pb.GenerateStreamResponse]]:
    """Collect a stream: (all token ids, tokens per message, text, messages)."""
    messages = list(stub.GenerateStream(message, timeout=CALL_TIMEOUT_S))
    ids = [t for m in messages for t in m.token_ids]
    return ids, [len(m.token_ids) for m in messages], "".join(m.text for m in messages), messages


@pytest.mark.parametrize(
    "mode, k",
    [(pb.SPECULATION_MODE_SD, 1), (pb.SPECULATION_MODE_SD, 4), (pb.SPECULATION_MODE_SD, 8), (pb.SPECULATION_MODE_OFF, 4)],
    ids=["sd-k1", "sd-k4", "sd-k8", "off"],
)
def test_greedy_equals_target_alone(stub, reference, mode, k):
    model, _, prompts, greedy = reference
    for text in PROMPTS[:4]:
        response = stub.Generate(request(prompts[text], mode=mode, k=k, max_new_tokens=MAX_NEW), timeout=CALL_TIMEOUT_S)
        assert response.finish_reason == pb.FINISH_REASON_LENGTH
        assert response.usage.completion_tokens == MAX_NEW
        assert response.usage.prompt_tokens == len(prompts[text])
        assert response.stats.mode == mode
        assert not response.stats.fallback_reason
        assert_greedy_equal_or_near_tie(model, prompts[text], list(response.token_ids), greedy[text])
        if mode == pb.SPECULATION_MODE_SD:
            assert response.stats.draft_tokens > 0
            assert response.stats.rounds < MAX_NEW  # the draft saved target forwards
        else:
            assert response.stats.rounds == MAX_NEW and response.stats.draft_tokens == 0


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


def test_text_prompt_equals_token_prompt(stub, reference):
    model, tokenizer, prompts, greedy = reference
    text = PROMPTS[0]
    response = stub.Generate(request(prompt=text), timeout=CALL_TIMEOUT_S)
    assert response.usage.prompt_tokens == len(prompts[text])
    assert_greedy_equal_or_near_tie(model, prompts[text], list(response.token_ids), greedy[text])
    assert response.text == tokenizer.decode(list(response.token_ids), skip_special_tokens=True)


def test_every_acceptance_count_occurs_and_stats_agree(stub, reference):
    """Per-round k from the stream (a round emits k+1 tokens); every k in 0..K occurs for K = 4."""
    _, _, prompts, _ = reference
    k_max = 4
    seen: set[int] = set()
    for text in PROMPTS:
        ids, sizes, _, messages = _stream(stub, request(prompts[text], k=k_max))
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


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_OFF], ids=["sd", "off"])
def test_stream_equals_unary(stub, reference, mode):
    _, _, prompts, _ = reference
    for text, temperature in ((PROMPTS[2], 0.0), (PROMPTS[3], 1.0)):
        message = request(prompts[text], mode=mode, temperature=temperature, seed=11, return_logprobs=True)
        unary = stub.Generate(message, timeout=CALL_TIMEOUT_S)
        ids, _, streamed_text, messages = _stream(stub, message)
        assert ids == list(unary.token_ids)
        assert streamed_text == unary.text
        assert [lp for m in messages for lp in m.logprobs] == pytest.approx(list(unary.logprobs), abs=1e-6)
        last = messages[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.usage == unary.usage
        assert last.stats.rounds == unary.stats.rounds and last.stats.seed == 11
        assert last.stats.mode == mode
        assert all(not m.HasField("stats") for m in messages[:-1])


def test_concurrent_requests_get_their_own_answers(stub, reference):
    model, _, prompts, greedy = reference
    new_tokens = 24

    def one(text: str):
        k = 1 + PROMPTS.index(text) % 4
        return text, stub.Generate(request(prompts[text], k=k, max_new_tokens=new_tokens), timeout=CALL_TIMEOUT_S)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, PROMPTS))
    assert len(results) == 8
    for text, response in results:
        assert_greedy_equal_or_near_tie(model, prompts[text], list(response.token_ids), greedy[text][:new_tokens])


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_OFF], ids=["sd", "off"])
def test_sampling_is_reproducible_by_seed(stub, reference, mode):
    _, _, prompts, greedy = reference
    ids = prompts[PROMPTS[4]]

    def run(seed):
        response = stub.Generate(request(ids, mode=mode, temperature=1.0, seed=seed, max_new_tokens=32), timeout=CALL_TIMEOUT_S)
        assert response.stats.seed == seed
        assert response.stats.mode == mode
        return list(response.token_ids)

    first = run(1234)
    assert run(1234) == first
    others = [run(seed) for seed in (1, 2)]
    assert any(o != first for o in others), "the seed does not change the sample"
    assert len(first) == 32


def test_unseeded_sampling_reports_its_seed_and_replays(stub, reference):
    _, _, prompts, _ = reference
    ids = prompts[PROMPTS[5]]
    first = stub.Generate(request(ids, temperature=1.0, max_new_tokens=24), timeout=CALL_TIMEOUT_S)
    replay = stub.Generate(request(ids, temperature=1.0, seed=first.stats.seed, max_new_tokens=24), timeout=CALL_TIMEOUT_S)
    assert list(replay.token_ids) == list(first.token_ids)


PENALTY = 1.5


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_SSD], ids=["off", "sd", "ssd"])
def test_greedy_under_a_repetition_penalty_equals_target_alone(stub, reference, mode):
    """The target applies the penalty over the prompt and every token before each verified
    position, drafts included, as transformers' generate(repetition_penalty=...) does."""
    model, _, prompts, greedy = reference
    changed = 0
    for text in PROMPTS[:4]:
        want = greedy_reference(model, prompts[text], MAX_NEW, repetition_penalty=PENALTY)
        changed += want != greedy[text]
        message = request(prompts[text], mode=mode, max_new_tokens=MAX_NEW)
        message.sampling.repetition_penalty = PENALTY
        response = stub.Generate(message, timeout=CALL_TIMEOUT_S)
        assert response.stats.mode == mode and not response.stats.fallback_reason
        assert_greedy_equal_or_near_tie(model, prompts[text], list(response.token_ids), want, repetition_penalty=PENALTY)
        if mode != pb.SPECULATION_MODE_OFF:
            assert response.stats.accepted_tokens > 0
    assert changed, "the penalty changed no reference: this test would pass with it ignored"


def test_stop_string_cuts_the_text(stub, reference):
    _, _, prompts, _ = reference
    ids = prompts[PROMPTS[0]]
    full = stub.Generate(request(ids, max_new_tokens=MAX_NEW), timeout=CALL_TIMEOUT_S)
    text = full.text
    assert len(text) > 20
    stop = text[12:15]
    cut = text.find(stop)
    for mode in (pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_OFF):
        response = stub.Generate(request(ids, mode=mode, max_new_tokens=MAX_NEW, stop=["never-there", stop]), timeout=CALL_TIMEOUT_S)
        assert response.finish_reason == pb.FINISH_REASON_STOP
        assert response.stop_reason == stop
        assert response.text == text[:cut]
        assert len(response.token_ids) < MAX_NEW
        assert list(response.token_ids) == list(full.token_ids)[: len(response.token_ids)]
        streamed_ids, _, streamed_text, messages = _stream(stub, request(ids, mode=mode, max_new_tokens=MAX_NEW, stop=[stop]))
        assert streamed_text == text[:cut] and streamed_ids == list(response.token_ids)
        assert messages[-1].finish_reason == pb.FINISH_REASON_STOP


def test_logprobs_are_the_targets_raw_log_softmax(stub, reference):
    model, _, prompts, _ = reference
    ids = prompts[PROMPTS[6]]
    for mode, temperature in ((pb.SPECULATION_MODE_SD, 0.0), (pb.SPECULATION_MODE_SD, 0.8), (pb.SPECULATION_MODE_OFF, 1.0)):
        message = request(ids, mode=mode, temperature=temperature, seed=5, max_new_tokens=24, return_logprobs=True)
        message.sampling.top_k = 20
        response = stub.Generate(message, timeout=CALL_TIMEOUT_S)
        tokens = list(response.token_ids)
        assert len(response.logprobs) == len(tokens) == 24
        assert all(lp <= 0 for lp in response.logprobs)
        logits = full_logits(model, ids + tokens)[len(ids) - 1 : -1]  # [24, V]: the logits each token was drawn after
        want = logits.log_softmax(-1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(torch.tensor(list(response.logprobs)), want, rtol=0, atol=1e-4)
    without = stub.Generate(request(ids, max_new_tokens=8), timeout=CALL_TIMEOUT_S)
    assert len(without.logprobs) == 0


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
    assert all(m.request_id == "abc-123" for m in _stream(stub, request(prompts[PROMPTS[0]], max_new_tokens=4, request_id="abc-123"))[3])


# ---------------------------------------------------------------- EOS list and chat template

CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def eos_setup(tiny_pair, reference, tmp_path_factory):
    """A target copy whose generation_config lists two EOS ids, each the greedy continuation's
    token at some point of one prompt (and absent before it), plus a chat template."""
    _, _, prompts, greedy = reference
    a, b = greedy[PROMPTS[0]], greedy[PROMPTS[3]]
    # Prompt A must first meet x at ja and prompt B first meet y at jb (neither meets the other id first).
    ja, jb = next(
        (i, j)
        for i in range(3, len(a))
        for j in range(3, len(b))
        if a[i] not in a[:i] and b[j] not in b[:j] and a[i] != b[j] and b[j] not in a[: i + 1] and a[i] not in b[: j + 1]
    )
    x, y = a[ja], b[jb]
    folder = copy_target(tiny_pair[0], tmp_path_factory.mktemp("eos_target"), eos_token_ids=[x, y], chat_template=CHAT_TEMPLATE)
    with running_stack(folder, tiny_pair[1]) as running:
        yield running, {PROMPTS[0]: (ja, x), PROMPTS[3]: (jb, y)}, folder


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_OFF], ids=["sd", "off"])
def test_each_eos_id_stops_generation(eos_setup, reference, mode):
    running, stops, _ = eos_setup
    _, _, prompts, greedy = reference
    stub = running.stub()
    for text, (index, eos) in stops.items():
        response = stub.Generate(request(prompts[text], mode=mode, ignore_eos=False, max_new_tokens=MAX_NEW), timeout=CALL_TIMEOUT_S)
        assert response.finish_reason == pb.FINISH_REASON_STOP
        assert response.stop_reason == "eos"
        assert list(response.token_ids) == greedy[text][: index + 1]
        assert response.token_ids[-1] == eos
        assert response.usage.completion_tokens == index + 1
        # ignore_eos runs on to the full length.
        full = stub.Generate(request(prompts[text], mode=mode, ignore_eos=True, max_new_tokens=MAX_NEW), timeout=CALL_TIMEOUT_S)
        assert full.finish_reason == pb.FINISH_REASON_LENGTH and list(full.token_ids) == greedy[text]


def test_chat_messages_use_the_template(eos_setup, reference):
    running, _, folder = eos_setup
    model, tokenizer, _, _ = reference
    stub = running.stub()
    messages = [pb.ChatMessage(role="system", content="Be brief."), pb.ChatMessage(role="user", content="def add(a, b):")]
    rendered = "<system>Be brief.\n<user>def add(a, b):\n<assistant>"
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    message = request(None, max_new_tokens=16)
    message.messages.messages.extend(messages)
    response = stub.Generate(message, timeout=CALL_TIMEOUT_S)
    assert response.usage.prompt_tokens == len(ids)
    assert_greedy_equal_or_near_tie(model, ids, list(response.token_ids), greedy_reference(model, ids, 16))


def test_every_chat_role_is_rendered(eos_setup):
    """system, user, assistant and tool (OpenAI's roles that templates render) all reach the template."""
    running, _, folder = eos_setup
    from transformers import AutoTokenizer

    roles = ["system", "user", "assistant", "tool", "user"]
    message = request(None, max_new_tokens=2)
    message.messages.messages.extend(pb.ChatMessage(role=role, content=f"{role} {i}") for i, role in enumerate(roles))
    rendered = "".join(f"<{role}>{role} {i}\n" for i, role in enumerate(roles)) + "<assistant>"
    response = running.stub().Generate(message, timeout=CALL_TIMEOUT_S)
    assert response.usage.prompt_tokens == len(AutoTokenizer.from_pretrained(folder).encode(rendered, add_special_tokens=False))


def test_chat_messages_without_a_template_are_refused(stub):
    import grpc

    message = request(None, max_new_tokens=4)
    message.messages.messages.append(pb.ChatMessage(role="user", content="hi"))
    with pytest.raises(grpc.RpcError) as raised:
        stub.Generate(message, timeout=CALL_TIMEOUT_S)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat template" in raised.value.details()
