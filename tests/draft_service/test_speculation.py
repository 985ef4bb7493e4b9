"""The draft worker's tree build (draft_service/speculation.py) against plain autoregressive drafting.

A branch is a real hit only if its tokens are what a Propose after committed + d_1..d_k + t*
would draft: the tree's shared-prefix forward with a 4-D mask must equal the plain one.
"""

from __future__ import annotations

import threading

import pytest
import torch

from draft_service.runner import DraftModelRunner
from draft_service.speculation import SpeculationCancelled, _guesses
from specd.core.sampling import SamplingSettings
from specd.engine.loading import load_causal_lm
from specd.engine.session_cache import SessionStore
from tests.runner_calls import draft_propose, draft_speculate
from tests.tiny_models import build_tokenizer

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


@pytest.fixture(scope="module")
def runner(tiny_pair):
    loaded = load_causal_lm(tiny_pair[1], dtype="float32", device="cpu")
    return DraftModelRunner(loaded, SessionStore(max_sessions=64, idle_timeout_s=300.0), max_support=64)


def _fresh(runner, sid: str, committed: list[int]) -> None:
    runner.end_session(sid)
    runner.prefill(sid, 0, committed)


@pytest.mark.parametrize("num_draft, num_tokens", [(0, 3), (1, 1), (4, 4), (8, 3)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_branches_equal_autoregressive_proposals(runner, num_draft, num_tokens, temperature):
    _assert_branches_equal_proposals(runner, num_draft, num_tokens, temperature)


def _sliding_window_config(kind: str):
    """A tiny config whose window (4) is shorter than PROMPT: all layers windowed, or mixed."""
    from transformers import MistralConfig, Qwen2Config

    common = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.25)
    if kind == "all-windowed":
        return MistralConfig(sliding_window=4, **common)
    return Qwen2Config(use_sliding_window=True, sliding_window=4, max_window_layers=1, **common)  # full, then windowed


@pytest.fixture(scope="module", params=["all-windowed", "mixed"])
def windowed_runner(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    folder = tmp_path_factory.mktemp(f"windowed-{request.param}")
    AutoModelForCausalLM.from_config(_sliding_window_config(request.param)).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    loaded = load_causal_lm(str(folder), dtype="float32", device="cpu")
    return DraftModelRunner(loaded, SessionStore(max_sessions=64, idle_timeout_s=300.0), max_support=64)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_branches_equal_proposals_under_a_sliding_window(windowed_runner, temperature):
    """The tree's mask applies the window at each branch's own positions, as a plain forward does."""
    _assert_branches_equal_proposals(windowed_runner, 4, 4, temperature)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_branches_equal_proposals_under_a_repetition_penalty(runner, temperature):
    """Each branch and each guess is penalised over its own history, as a Propose after it is."""
    _assert_branches_equal_proposals(runner, 4, 4, temperature, repetition_penalty=1.8)


def test_proposals_apply_the_repetition_penalty_as_transformers_does(runner, tiny_pair):
    """A greedy Propose under a penalty drafts what the draft model alone decodes under it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1], dtype=torch.float32)
    prompt = PROMPT * 3  # repeats, for the penalty to act on
    wanted = {}
    for penalty in (1.0, 1.8):
        output = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, max_new_tokens=12, repetition_penalty=penalty, pad_token_id=0)
        wanted[penalty] = output[0, len(prompt):].tolist()
        _fresh(runner, "penalised", prompt)
        proposal = draft_propose(runner, "penalised", 0, prompt, 12, SamplingSettings(repetition_penalty=penalty), 0)
        assert proposal.draft_tokens == wanted[penalty], penalty
    assert wanted[1.8] != wanted[1.0], "the penalty changed nothing here: the test would pass with it ignored"


def _assert_branches_equal_proposals(
    runner, num_draft: int, num_tokens: int, temperature: float, prompt: list[int] = PROMPT, repetition_penalty: float = 1.0
) -> None:
    sampling = SamplingSettings(
        temperature=temperature, top_p=0.9 if temperature else 1.0, seed=1234, repetition_penalty=repetition_penalty
    )
    _fresh(runner, "tree", prompt)
    drafts = draft_propose(runner, "tree", 0, prompt, num_draft, sampling, 0).draft_tokens if num_draft else []
    fanout = [2] * num_draft + [3]
    result = draft_speculate(runner, "tree", 0, prompt, drafts, num_tokens, fanout, sampling, 0, 1.0, [], threading.Event())
    assert len(result.branches) == sum(fanout)
    # The tree is gone: the session caches exactly committed + d_1..d_K.
    session = runner.sessions.open("tree", 0)
    assert session.cached_tokens == prompt + drafts
    assert session.cache.get_seq_length() == len(prompt) + num_draft
    for branch in result.branches:
        k = branch.accepted
        if k < num_draft:
            assert branch.next_token != drafts[k], "a drafted token is never the recovered token"
        history = prompt + drafts[:k] + [branch.next_token]
        _fresh(runner, "plain", history)
        plain = draft_propose(runner, "plain", 0, history, num_tokens, sampling, 0)
        assert branch.draft_tokens == plain.draft_tokens, (k, branch.next_token)
        for tree_q, plain_q in zip(branch.draft_dists, plain.draft_dists):
            assert tree_q.token_ids[:8] == plain_q.token_ids[:8]
            assert torch.allclose(torch.tensor(tree_q.probs), torch.tensor(plain_q.probs), atol=1e-5)
    # The guesses at each position are the draft's top tokens there (greedy: the argmax first).
    if temperature == 0.0:
        by_k = {}
        for branch in result.branches:
            by_k.setdefault(branch.accepted, []).append(branch.next_token)
        assert sorted(by_k) == list(range(num_draft + 1))
        assert all(len(v) == fanout[k] for k, v in by_k.items())


def test_session_continues_after_a_build(runner):
    """After a build, syncing to the winning branch's history and drafting again is plain drafting."""
    sampling = SamplingSettings(temperature=0.0)
    _fresh(runner, "cont", PROMPT)
    drafts = draft_propose(runner, "cont", 0, PROMPT, 4, sampling, 0).draft_tokens
    result = draft_speculate(runner, "cont", 0, PROMPT, drafts, 4, [1, 1, 1, 1, 2], sampling, 0, 1.0, [], threading.Event())
    branch = next(b for b in result.branches if b.accepted == 2)
    history = PROMPT + drafts[:2] + [branch.next_token]
    again = draft_propose(runner, "cont", len(PROMPT), history[len(PROMPT):], 4, sampling, 0)
    assert again.draft_tokens == branch.draft_tokens


def test_zero_budget_builds_nothing_and_keeps_the_session_in_step(runner):
    sampling = SamplingSettings(temperature=0.0)
    _fresh(runner, "zero", PROMPT)
    drafts = draft_propose(runner, "zero", 0, PROMPT, 3, sampling, 0).draft_tokens
    result = draft_speculate(runner, "zero", 0, PROMPT, drafts, 3, [0, 0, 0, 0], sampling, 0, 1.0, [], threading.Event())
    assert result.branches == []
    assert runner.sessions.open("zero", 0).cached_tokens == PROMPT + drafts


def test_cancel_stops_the_build_and_restores_the_cache(runner):
    sampling = SamplingSettings(temperature=0.0)
    _fresh(runner, "cancel", PROMPT)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(SpeculationCancelled):
        draft_speculate(runner, "cancel", 0, PROMPT, [1, 2], 4, [2, 2, 2], sampling, 0, 1.0, [], cancel)
    session = runner.sessions.open("cancel", 0)
    assert session.cache.get_seq_length() == len(session.cached_tokens) == len(PROMPT) + 2


def test_saguaro_reshapes_the_branch_distributions(runner):
    sampling = SamplingSettings(temperature=1.0, seed=7)
    _fresh(runner, "sag", PROMPT)
    plain = draft_speculate(runner, "sag", 0, PROMPT, [], 2, [2], sampling, 0, 1.0, [], threading.Event())
    shaped = draft_speculate(runner, "sag", 0, PROMPT, [], 2, [2], sampling, 0, 0.25, [3, 3], threading.Event())
    for a, b in zip(plain.branches, shaped.branches):
        q, q_prime = a.draft_dists[0], b.draft_dists[0]
        assert q.token_ids == q_prime.token_ids
        top = q.probs[:3]
        ratio = q_prime.probs[5] / q.probs[5]  # off the top 3: scaled up by the renormalisation
        assert q_prime.probs[:3] == pytest.approx([p * 0.25 * ratio for p in top], rel=1e-4)


def _draft_distributions(logits, settings, max_support, saguaro_c, saguaro_f):
    """Each row's q as a draft step makes it: its reads, read back, then the distributions."""
    from draft_service.speculation import distributions_from, draft_reads
    from specd.engine.host_copy import to_host

    return distributions_from(to_host(*draft_reads(logits, settings, max_support, saguaro_c, saguaro_f)), settings)


@pytest.mark.parametrize(
    "settings",
    [
        SamplingSettings(temperature=1.0),
        SamplingSettings(temperature=0.7, top_p=0.9),
        SamplingSettings(temperature=1.3, top_k=20, top_p=0.8),
        SamplingSettings(temperature=1.0, top_k=200),
    ],
)
def test_batched_draft_distributions_equal_the_reference_processing(settings):
    """The draft's batched top-N q equals the target's processing followed by truncate_to_top."""
    from specd.core.logits import logits_to_probs
    from tests.distributions import truncate_to_top

    logits = torch.randn(6, 4096, generator=torch.Generator().manual_seed(2)) * 3  # [R, V]
    for row, dist in enumerate(_draft_distributions(logits, settings, 64, 1.0, 0)):
        want = truncate_to_top(logits_to_probs(logits[row], settings), 64)
        assert dist.token_ids == want.token_ids
        assert dist.probs == pytest.approx(want.probs, abs=1e-6)


def test_saguaro_at_c_0_sends_the_q_it_samples_from():
    """C = 0 zeroes the draft's top F tokens and top-p its tail: q' keeps exactly the tokens
    between, renormalised, so the verifier is told the q the draft samples from."""
    from specd.core.logits import logits_to_probs

    logits = torch.tensor([[5.0, 4.5, 4.0, 3.5, 3.0] + [-50.0] * 59])  # [1, 64]
    settings = SamplingSettings(temperature=1.0, top_p=0.999)
    (dist,) = _draft_distributions(logits, settings, 64, 0.0, 2)
    probs = logits_to_probs(logits[0], settings)  # [64]: the top 5 tokens hold all of top-p's mass
    assert sorted(dist.token_ids) == [2, 3, 4]
    want = probs[[2, 3, 4]] / probs[[2, 3, 4]].sum()
    assert [dist.probs[dist.token_ids.index(t)] for t in (2, 3, 4)] == pytest.approx(want.tolist(), abs=1e-6)
    assert sum(dist.probs) == pytest.approx(1.0, abs=1e-6)


def test_guesses_take_each_position_s_own_top_tokens_from_one_top_k():
    """Positions without branches between and around those with them (one top-k over the span)."""
    logits = torch.tensor([
        [0.0, 9.0, 1.0, 2.0, 3.0],  # j = 0: no branches
        [5.0, 1.0, 4.0, 0.0, 3.0],  # j = 1: d_2 = 0 left out -> 2, 4
        [1.0, 2.0, 3.0, 4.0, 5.0],  # j = 2: no branches
        [2.0, 0.0, 1.0, 9.0, 8.0],  # j = 3 (= K): 3, 4, 0
        [9.0, 8.0, 7.0, 6.0, 5.0],  # j = 4: no branches, past the last with some
    ])
    assert _guesses(logits[:4], [1, 0, 3], [0, 2, 0, 3], [None] * 4) == [(1, 2), (1, 4), (3, 3), (3, 4), (3, 0)]
    assert _guesses(logits, [1, 0, 3, 2], [0, 0, 0, 0, 0], [None] * 5) == []
    assert _guesses(logits[:2], [1], [0, 9], [None, None]) == [(1, 0), (1, 2), (1, 4), (1, 1), (1, 3)]  # more than the vocabulary
