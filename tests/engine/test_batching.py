"""Batched forwards: sessions ready together share one forward and get what they would alone.

The packed forward against each session's lone forward (ragged lengths, different contexts,
rollback in between); the target runner's verify batch against lone verifies, greedy and
sampled; the batcher's rules (one call per session per batch, a cancelled call never runs, a
failing call fails alone); and a served stack whose concurrent requests share target forwards
and still decode what they decode alone.
"""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

from specd.core.errors import SessionNotFound
from specd.core.sampling import SamplingSettings, SparseDist
from specd.engine.batcher import Batcher
from specd.engine.kv_cache import GrowingKVCache
from specd.engine.loading import load_causal_lm
from specd.engine.packed_forward import Segment, enable_packing
from specd.engine.session_cache import SessionStore
from specd.engine.step_batcher import StepBatcher, run_alone
from specd.v1 import coordinator_pb2 as pb
from target_service.calls import VerifyCall
from target_service.runner import TargetModelRunner
from tests.conftest import CALL_TIMEOUT_S, assert_greedy_equal_or_near_tie, request, running_stack
from tests.tiny_models import build_llama

TOLERANCE = 1e-4  # a packed row's logits against its lone forward's: summation order only


@pytest.fixture(scope="module")
def model():
    return build_llama(384, seed=3).eval()


def _lone(model, cache, tokens: list[int], visible=None, positions=None) -> torch.Tensor:
    mask = None
    if visible is not None:
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf")).view(1, 1, *visible.shape)
    position_ids = torch.tensor([positions]) if positions is not None else None
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([tokens]), past_key_values=cache, attention_mask=mask, position_ids=position_ids)
    return out.logits[0].float()  # [L, V]


def test_packed_sessions_get_their_lone_logits_through_steps_and_rollbacks(model):
    packer = enable_packing(model)
    assert packer is not None
    lengths = [[17, 3, 1, 5], [4, 1, 9, 1], [30, 6, 2, 2], [1, 2, 1, 7]]  # per session, per step
    check_packed_steps(model, packer, lengths, [GrowingKVCache() for _ in lengths])


def check_packed_steps(model, packer, lengths: list[list[int]], packed: list) -> None:
    """Four packed forwards of the sessions whose caches are `packed` (feeding `lengths[i][step]`
    tokens), each session's rows against its lone forward's, with two rollbacks after the second."""
    generator = torch.Generator().manual_seed(1)
    lone = [GrowingKVCache() for _ in lengths]
    for step in range(4):
        feeds = [torch.randint(0, 384, (n[step],), generator=generator).tolist() for n in lengths]
        want = [_lone(model, cache, feed) for cache, feed in zip(lone, feeds)]
        got, forward_ms = packer.forward([Segment(cache, feed, len(feed)) for cache, feed in zip(packed, feeds)])
        assert forward_ms > 0
        for w, g in zip(want, got):
            assert g.shape == w.shape and torch.allclose(w, g, rtol=TOLERANCE, atol=TOLERANCE)
        if step == 1:  # rejected draft tokens: two sessions roll back, each on its own
            for caches in (lone, packed):
                caches[0].crop(-2)
                caches[2].crop(-1)
        assert [c.get_seq_length() for c in packed] == [c.get_seq_length() for c in lone]


def test_a_packed_tree_segment_sees_only_its_branch(model):
    packer = enable_packing(model)
    prompt = list(range(10, 22))
    lone, packed, other = GrowingKVCache(), GrowingKVCache(), GrowingKVCache()
    _lone(model, lone, prompt)
    packer.forward([Segment(packed, prompt, 1), Segment(other, [5, 6, 7], 1)])
    cached = len(prompt)
    # Two branches of one token each after the prompt, then a child of the first.
    visible = torch.zeros(3, cached + 3, dtype=torch.bool)
    visible[:, :cached] = True
    visible[0, cached] = visible[1, cached + 1] = visible[2, cached] = visible[2, cached + 2] = True
    positions = [cached, cached, cached + 1]
    want = _lone(model, lone, [40, 41, 42], visible, positions)
    got, _ = packer.forward([Segment(other, [9], 1), Segment(packed, [40, 41, 42], 3, visible, positions)])
    assert torch.allclose(want, got[1], rtol=TOLERANCE, atol=TOLERANCE)


def test_models_packing_does_not_fit_are_refused():
    import transformers

    from tests.tiny_models import architecture_config

    for kind in ("gpt2", "qwen2", "gemma2"):  # no rotary module; windowed layers; soft-capping
        config = architecture_config(kind, 384, 0)
        assert enable_packing(transformers.AutoModelForCausalLM.from_config(config).eval()) is None, kind


def test_a_bfloat16_model_keeps_packing_and_its_check_still_sees_a_wrong_mask(model):
    """Packing's self-check compares half-precision logits to their rounding: a bfloat16 model (a
    GPU worker's default) still packs, and a row that sees one token too many still fails it."""
    from specd.engine.packed_forward import _close

    half = build_llama(384, seed=3).eval().to(torch.bfloat16)
    assert enable_packing(half) is not None
    tokens = list(range(40, 49))
    want = _lone(half, None, tokens)  # [9, V]
    rounded = _lone(half, None, tokens, positions=list(range(1, 10)))  # same logits, rounded elsewhere
    one_too_many = _lone(half, None, [7, *tokens])[1:]  # every row sees a token from before
    assert _close(want[1:], rounded[1:], torch.bfloat16)
    assert not _close(want, one_too_many, torch.bfloat16)


@pytest.fixture(scope="module")
def runners(tiny_pair):
    """The same target twice: one verifies in batches, the other one session at a time."""
    loaded = load_causal_lm(tiny_pair[0], dtype="float32", device="cpu")
    batched = TargetModelRunner(loaded, SessionStore(16, 60.0))
    alone = TargetModelRunner(loaded, SessionStore(16, 60.0), pack=False)
    return batched, alone


def _calls(round_index: int, histories: list[list[int]], sampling: SamplingSettings, logprobs: bool = True) -> list[VerifyCall]:
    generator = torch.Generator().manual_seed(round_index)
    calls = []
    for i, history in enumerate(histories):
        num_draft = (i + round_index) % 5  # ragged: 0 (a plain step) to 4 draft tokens
        draft = torch.randint(0, 300, (num_draft,), generator=generator).tolist()
        dists = [] if sampling.greedy else [SparseDist([t, (t + 1) % 300], [0.6, 0.4]) for t in draft]
        calls.append(VerifyCall(f"s{i}", 0, list(history), draft, dists, sampling, logprobs))
    return calls


@pytest.mark.parametrize("temperature, logprobs", [(0.0, True), (0.0, False), (1.0, True)])
def test_a_run_batch_gives_each_session_its_lone_outcome(runners, temperature, logprobs):
    """Sampled, greedy with logprobs (each its own ratio test), and plain greedy (decided together)."""
    batched, alone = runners
    sampling = SamplingSettings(temperature=temperature, top_k=0, top_p=1.0, seed=11)
    histories = [list(range(5 + i, 5 + i + 3 * i + 2)) for i in range(6)]  # different context lengths
    for round_index in range(4):
        calls = _calls(round_index, histories, sampling, logprobs)
        got = batched.run_batch(calls)
        want = alone.run_batch(calls)
        for g, w in zip(got, want):
            assert (g.accepted, g.next_token, g.is_bonus, g.cached_tokens) == (w.accepted, w.next_token, w.is_bonus, w.cached_tokens)
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        for history, call, outcome in zip(histories, calls, got):  # the next round continues each
            history.extend(call.draft_tokens[: outcome.accepted] + [outcome.next_token])
    for runner in runners:
        for i in range(len(histories)):
            runner.end_session(f"s{i}")


def test_one_bad_call_fails_alone(runners):
    batched, _ = runners
    greedy = SamplingSettings(temperature=0.0, top_k=0, top_p=1.0, seed=0)
    calls = [VerifyCall("ok", 0, [1, 2, 3], [4], [], greedy, False), VerifyCall("gone", 5, [9], [4], [], greedy, False)]
    ok, gone = batched.run_batch(calls)
    assert isinstance(gone, SessionNotFound) and ok.cached_tokens == 4
    batched.end_session("ok")


@pytest.fixture(scope="module")
def draft_runner(tiny_pair):
    from draft_service.runner import DraftModelRunner

    loaded = load_causal_lm(tiny_pair[1], dtype="float32", device="cpu")
    runner = DraftModelRunner(loaded, SessionStore(16, 60.0), max_support=64)
    assert runner.packer is not None
    return runner


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_draft_jobs_of_different_sessions_share_forwards_and_draft_as_alone(draft_runner, temperature, monkeypatch):
    """Proposes of ragged lengths and a Speculate tree, stepped together (each forward's reads
    brought back in one wait), against each run alone."""
    import specd.engine.step_batcher as step_batcher

    read_backs = []
    monkeypatch.setattr(step_batcher, "to_host", lambda *t, read=step_batcher.to_host: read_backs.append(len(t)) or read(*t))
    sampling = SamplingSettings(temperature=temperature, top_k=0, top_p=0.95, seed=5)
    prompts = [list(range(7, 7 + n)) for n in (4, 11, 6)]
    model_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    sizes: list[int] = []
    steps = StepBatcher(model_thread.submit, draft_runner.packer, 8, lambda size, ms: sizes.append(size))
    held = threading.Event()
    model_thread.submit(held.wait, 5)  # everything below is pending when the first turn comes

    def jobs(tag: str):
        return [
            lambda: draft_runner.propose_job(f"{tag}0", 0, prompts[0], 3, sampling, 0),
            lambda: draft_runner.propose_job(f"{tag}1", 0, prompts[1], 6, sampling, 0),
            lambda: draft_runner.speculate_job(f"{tag}2", 0, prompts[2], [40, 41], 3, [2, 1, 2], sampling, 0, 1.0, [], threading.Event()),
        ]

    futures = [steps.start(make, i) for i, make in enumerate(jobs("b"))]
    held.set()
    together = [f.result(10) for f in futures]
    per_job = 1 if sampling.greedy else 2  # argmax ids; or q's probabilities and ids
    assert len(read_backs) == len(sizes) and max(read_backs) == 3 * per_job  # one a forward: two Proposes' and a tree step's
    alone = [model_thread.submit(lambda m=make: run_alone(m())).result(10) for make in jobs("a")]
    model_thread.shutdown()
    assert max(sizes) == 3  # the first steps ran as one forward
    for got, want in zip(together[:2], alone[:2]):
        assert got.draft_tokens == want.draft_tokens
        for g, w in zip(got.draft_dists, want.draft_dists):
            # The same q, token by token: a packed forward rounds otherwise than a lone one, so two
            # tokens of equal probability to rounding may come in either order (on one thread they do).
            assert dict(zip(g.token_ids, g.probs)) == pytest.approx(dict(zip(w.token_ids, w.probs)), abs=1e-4)
    tree, tree_alone = together[2], alone[2]
    assert [(b.accepted, b.next_token, b.draft_tokens) for b in tree.branches] == [
        (b.accepted, b.next_token, b.draft_tokens) for b in tree_alone.branches
    ]
    for tag in ("a", "b"):
        for i in range(3):
            draft_runner.end_session(f"{tag}{i}")


def test_the_batcher_batches_one_call_per_session_and_skips_cancelled_ones():
    model_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    batches: list[list[str]] = []
    gate = threading.Event()
    model_thread.submit(gate.wait, 5)  # a forward under way: everything below queues behind it

    def run_batch(items):
        batches.append(items)
        return [ValueError(item) if item.startswith("bad") else item.upper() for item in items]

    batcher = Batcher(model_thread.submit, run_batch, lambda item: item[0], max_batch=3)  # session: first letter
    futures = {item: batcher.submit(item) for item in ("a1", "b1", "a2", "a3", "c1", "bad", "e1", "f1")}
    futures["e1"].cancel()
    gate.set()
    assert [futures[i].result(5) for i in ("a1", "b1", "a2", "a3", "c1", "f1")] == ["A1", "B1", "A2", "A3", "C1", "F1"]
    with pytest.raises(ValueError):
        futures["bad"].result(5)
    assert futures["e1"].cancelled()
    # Oldest first, up to three, a session's later calls after its earlier one's batch.
    assert batches == [["a1", "b1", "c1"], ["a2", "bad", "f1"], ["a3"]]
    model_thread.shutdown()


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_SSD])
def test_concurrent_requests_share_target_forwards_and_decode_as_alone(tiny_pair, mode):
    from tests.conftest import greedy_reference, load_reference
    from tests.observability.test_metrics import scrape

    model, _ = load_reference(tiny_pair[0])
    prompts = [[5 + i, 17, 42 + i, 99, 7, 3 + 2 * i][: 3 + i % 4] for i in range(8)]
    on = {"metrics_port": 0}
    unlimited = {"speculation_max_running": 0}  # speculate at any load: the batched calls are the point
    with running_stack(*tiny_pair, target_overrides=on, draft_overrides=on, coordinator_overrides=unlimited) as stack:
        runner = stack.target.servicer.runner
        original = runner.run_batch

        def busy(calls, most_tokens=None):  # a forward long enough that the other requests' verifies queue behind it
            threading.Event().wait(0.02)
            return original(calls, most_tokens)

        runner.run_batch = busy
        stub = stack.stub()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            responses = list(pool.map(
                lambda p: stub.Generate(request(p, mode=mode, max_new_tokens=24), timeout=CALL_TIMEOUT_S), prompts
            ))
        target, draft = scrape(stack.target.metrics.port), scrape(stack.draft.metrics.port)
        assert _sessions_end(runner)
    for prompt, response in zip(prompts, responses):
        assert response.stats.mode == mode
        want = greedy_reference(model, prompt, 24)
        assert_greedy_equal_or_near_tie(model, prompt, list(response.token_ids), want)
    op = (("op", "verify"), ("role", "target"))
    forwards, sessions = target[("specd_forward_batch_size_count", op)], target[("specd_forward_batch_size_sum", op)]
    assert sessions > forwards, f"{forwards} verify forwards served {sessions} verifies: nothing was batched"
    if mode != pb.SPECULATION_MODE_OFF:  # the draft's steps: Propose (sd) or Speculate (ssd) of many sessions
        step = (("op", "step"), ("role", "draft"))
        assert draft[("specd_forward_batch_size_sum", step)] > draft[("specd_forward_batch_size_count", step)]


def _sessions_end(runner, seconds: float = 5.0) -> bool:
    """The coordinator ends its sessions just after answering: wait for that, within a deadline."""
    import time

    deadline = time.monotonic() + seconds
    while len(runner.sessions) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(runner.sessions) == 0


def test_a_batch_waits_briefly_for_the_sessions_of_the_last_one():
    """Answers go out together but next calls come back one by one: without the wait the first
    would run alone and the rest behind it, two forwards per round instead of one."""
    model_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    batches: list[list[str]] = []

    def run_batch(items):
        batches.append(items)
        if len(batches) == 1:
            threading.Event().wait(0.8)  # a long forward: the wait may be up to a quarter of it
        return items

    batcher = Batcher(model_thread.submit, run_batch, lambda item: item[0], max_batch=8, max_wait_s=5.0)
    gate = threading.Event()
    model_thread.submit(gate.wait, 5)
    first = [batcher.submit(item) for item in ("a1", "b1", "c1")]
    gate.set()
    [f.result(5) for f in first]
    second = [batcher.submit("a2")]
    threading.Event().wait(0.03)
    second += [batcher.submit("b2"), batcher.submit("c2")]
    [f.result(5) for f in second]
    third = [batcher.submit("a3")]  # b and c are gone: a3 waits out the bound, then runs
    assert third[0].result(5) == "a3"
    model_thread.shutdown()
    assert batches == [["a1", "b1", "c1"], ["a2", "b2", "c2"], ["a3"]]


def test_an_ended_session_s_queued_calls_never_run():
    """A call still queued when its session's EndSession comes would open the session again."""
    model_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    ran: list[str] = []
    batcher = Batcher(model_thread.submit, lambda items: ran.extend(items) or items, lambda item: item[0], max_batch=4)
    gate = threading.Event()
    model_thread.submit(gate.wait, 5)
    late, other = batcher.submit("a1"), batcher.submit("b1")
    batcher.forget("a")  # EndSession of a, while a1 waits for the model thread
    gate.set()
    assert other.result(5) == "b1" and late.cancelled() and ran == ["b1"]
    model_thread.shutdown()


def test_an_ended_session_s_jobs_not_yet_started_never_start(draft_runner):
    model_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    steps = StepBatcher(model_thread.submit, draft_runner.packer, 4)
    gate = threading.Event()
    model_thread.submit(gate.wait, 5)
    sampling = SamplingSettings(temperature=0.0, top_k=0, top_p=1.0, seed=0)
    late = steps.start(lambda: draft_runner.propose_job("ended", 0, [5, 6, 7], 2, sampling, 0), "ended")
    steps.forget("ended")
    gate.set()
    model_thread.submit(lambda: None).result(5)  # the turns after it have run
    assert late.cancelled() and "ended" not in draft_runner.sessions
    model_thread.shutdown()


def test_a_step_whose_read_fails_fails_alone():
    from specd.engine.step_batcher import Step, read_back

    def broken(logits):
        raise ValueError("no read")

    logits = torch.arange(6.0).view(2, 3)
    steps = [Step(None, None, lambda lg: (lg.argmax(-1),)), Step(None, None, broken), Step(None, None)]
    first, failed, nothing = read_back(steps, [(logits, 1.0), (logits, 2.0), (logits, 3.0)])
    assert first.read[0].tolist() == [2, 2] and first.forward_ms == 1.0
    assert isinstance(failed, ValueError) and nothing.read == [] and nothing.logits is logits


def test_a_failed_read_back_fails_every_job_of_its_forward_and_repeats_no_forward(draft_runner, monkeypatch):
    import specd.engine.step_batcher as step_batcher

    def unreadable(*tensors):
        raise RuntimeError("the read-back failed")

    monkeypatch.setattr(step_batcher, "to_host", unreadable)
    model_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    sizes: list[int] = []
    steps = StepBatcher(model_thread.submit, draft_runner.packer, 8, lambda size, ms: sizes.append(size))
    held = threading.Event()
    model_thread.submit(held.wait, 5)
    greedy = SamplingSettings()
    futures = [steps.start(lambda i=i: draft_runner.propose_job(f"r{i}", 0, [5, 6, 7 + i], 3, greedy, 0), i) for i in range(2)]
    held.set()
    for future in futures:
        with pytest.raises(RuntimeError, match="the read-back failed"):
            future.result(10)
    model_thread.shutdown()
    assert sizes == [2]  # the one forward, not run again
    for i in range(2):
        draft_runner.end_session(f"r{i}")
