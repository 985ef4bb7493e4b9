"""specd's draft model (specd/engine/draft_model.py): a folder with only its own weights loads with the
target's embedding and first layers borrowed, predicts only its reduced vocabulary, and
speculation with it stays exact: greedy output equals the target alone, and sampled tokens
outside the draft's vocabulary (q = 0 there) still come with the target's probability."""

from __future__ import annotations

import pytest
import scipy.stats
import torch
from safetensors import safe_open

from specd.core.sampling import SamplingSettings
from specd.engine.backends.cpu_kernels import prepacked_linear
from specd.engine.backends.cpu_kernels.prepacked_linear import prepack_linears
from specd.engine.draft_model import DraftLlamaForCausalLM
from specd.engine.lean_llama import LeanLlama, lean_or_plain
from specd.engine.loading import load_causal_lm
from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, greedy_reference, load_reference, request, running_stack
from tests.e2e.test_ssd_distribution import _pit
from tests.tiny_models import save_reduced_vocab_draft

DRAFT_VOCAB = 96  # of the tiny tokenizer's 384 ids


@pytest.fixture(scope="module")
def reduced_draft(tiny_pair, tmp_path_factory) -> str:
    return save_reduced_vocab_draft(tmp_path_factory.mktemp("reduced") / "draft", tiny_pair[0], DRAFT_VOCAB)


def test_the_folder_holds_only_the_drafts_own_weights(reduced_draft):
    with safe_open(f"{reduced_draft}/model.safetensors", framework="pt") as handle:
        keys = set(handle.keys())
        assert handle.get_tensor("lm_head.weight").dtype == torch.bfloat16
    assert "model.embed_tokens.weight" not in keys
    assert not any(k.startswith("model.layers.0.") for k in keys)
    assert any(k.startswith("model.layers.1.") for k in keys)
    assert {"lm_head.weight", "lm_head.token_ids", "model.norm.weight"} <= keys


def test_loading_borrows_the_targets_embedding_and_first_layer(tiny_pair, reduced_draft):
    target = load_causal_lm(tiny_pair[0]).model
    draft = load_causal_lm(reduced_draft).model
    assert isinstance(draft, DraftLlamaForCausalLM)
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    for name, param in target.model.layers[0].named_parameters():
        assert torch.equal(draft.model.layers[0].get_parameter(name), param), name


@torch.inference_mode()
def test_logits_are_minus_infinity_outside_the_draft_vocabulary(reduced_draft):
    draft = load_causal_lm(reduced_draft).model
    logits = draft(input_ids=torch.tensor([[1, 5, 9, 2]])).logits[0]  # [4, V]
    inside = torch.zeros(logits.shape[-1], dtype=torch.bool)
    inside[torch.arange(DRAFT_VOCAB) * 2] = True
    assert bool(torch.isfinite(logits[:, inside]).all())
    assert bool((logits[:, ~inside] == float("-inf")).all())
    assert bool(inside[logits.argmax(-1)].all())


@torch.inference_mode()
def test_prepacking_packs_the_reduced_output_layer_too(reduced_draft):
    plain = load_causal_lm(reduced_draft).model
    packed = load_causal_lm(reduced_draft).model
    state = {key: value.clone() for key, value in packed.state_dict().items()}
    if not prepacked_linear._ops_available():
        pytest.skip("torch built without oneDNN")

    prepack_linears(packed)
    assert isinstance(packed.lm_head._product, prepacked_linear.PackedProduct)
    assert packed.lm_head._product.weight is packed.lm_head.weight
    after = packed.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[key], state[key]) for key in state)
    ids = torch.tensor([[1, 5, 9, 2, 7]])  # [1, 5]: several rows, the packed product
    want, got = plain(input_ids=ids).logits[0], packed(input_ids=ids).logits[0]  # [5, V]
    assert torch.equal(torch.isinf(want), torch.isinf(got))
    assert torch.allclose(want, got, rtol=1e-4, atol=1e-4) and want.argmax(-1).equal(got.argmax(-1))


def test_the_lean_forward_serves_it(reduced_draft):
    assert isinstance(lean_or_plain(load_causal_lm(reduced_draft).model), LeanLlama)


@pytest.fixture(scope="module")
def stack(tiny_pair, reduced_draft):
    with running_stack(tiny_pair[0], reduced_draft) as running:
        yield running


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_SSD])
def test_greedy_output_equals_the_target_alone(stack, tiny_pair, mode):
    model, tokenizer = load_reference(tiny_pair[0])
    prompt_ids = tokenizer.encode("def add(a, b):")
    want = greedy_reference(model, prompt_ids, 40)
    response = stack.stub().Generate(request(prompt_ids, mode=mode, k=4, max_new_tokens=40), timeout=CALL_TIMEOUT_S)
    assert response.stats.mode == mode and response.stats.draft_tokens > 0
    assert list(response.token_ids) == want


def test_sampled_sd_follows_the_target_beyond_the_draft_vocabulary(stack, tiny_pair):
    """Kolmogorov-Smirnov over the PIT of every token (tests/e2e/test_ssd_distribution.py), alpha 1e-3."""
    model, tokenizer = load_reference(tiny_pair[0])
    prompt_ids = tokenizer.encode("class Point:")
    sequences = []
    for seed in range(80):
        message = request(prompt_ids, mode=pb.SPECULATION_MODE_SD, k=3, max_new_tokens=16, temperature=1.0, seed=seed)
        sequences.append(list(stack.stub().Generate(message, timeout=CALL_TIMEOUT_S).token_ids))
    outside = sum(1 for tokens in sequences for t in tokens if t % 2 or t >= 2 * DRAFT_VOCAB)
    assert outside > 100  # the case this test is for: tokens the draft can never propose
    values = _pit(model, prompt_ids, sequences, SamplingSettings(temperature=1.0))
    assert scipy.stats.kstest(values, "uniform").pvalue > 1e-3
