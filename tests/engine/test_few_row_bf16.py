"""Products of a few rows on bfloat16 copies of a draft's weights (`--few-row-bf16`): the kernel
reads bfloat16 as the float32 it widens to, a halved model sends 1-8 rows to it and more to
oneDNN's float32 copy, the draft worker halves by default and the target worker never does,
and a stack on one thread per worker (the kernel's products everywhere, the draft's halved)
still writes the target's greedy output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specd.engine.backends.cpu_kernels import small_rows_kernel
from specd.engine.backends.cpu_kernels.prepacked_linear import PrepackedLinear, prepack_linears
from tests.conftest import (
    CALL_TIMEOUT_S,
    assert_greedy_equal_or_near_tie,
    greedy_reference,
    load_reference,
    request,
    running_stack,
)
from tests.cpu_products import INNER_OUT, builds_here, count_kernel_products, feed_side_by_side, needs_onednn
from tests.tiny_models import build_llama

VOCAB = 96


@pytest.fixture
def kernel():
    loaded = small_rows_kernel.load_checked()
    if loaded is None:
        pytest.skip("the few-row kernel does not run on this CPU")
    return loaded


@builds_here
@pytest.mark.parametrize("inner,out", INNER_OUT)
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_bf16_weight_gives_bitwise_the_float32_product_of_its_widened_values(kernel, inner, out, with_bias):
    generator = torch.Generator().manual_seed(inner + out)
    half = torch.randn(out, inner, generator=generator).to(torch.bfloat16)  # [out, in]
    widened = half.float()  # [out, in]: exactly the bfloat16 values
    bias = torch.randn(out, generator=generator) if with_bias else None  # [out]
    assert kernel.takes(half, bias)
    for rows in range(1, small_rows_kernel.MAX_ROWS + 1):
        x = torch.randn(rows, inner, generator=generator)  # [rows, in]
        got = kernel.product(x, half, bias)  # [rows, out]
        assert torch.equal(got, kernel.product(x, widened, bias)), f"{rows} rows"
        assert torch.allclose(got, nn.functional.linear(x, widened, bias), rtol=1e-5, atol=1e-4), f"{rows} rows"


def test_the_kernel_takes_bf16_weights_but_not_bf16_biases_or_float16():
    takes = small_rows_kernel.SmallRowsKernel.takes
    assert takes(torch.randn(8, 64).to(torch.bfloat16), torch.randn(8))
    assert not takes(torch.randn(8, 64).to(torch.bfloat16), torch.randn(8).to(torch.bfloat16))
    assert not takes(torch.randn(8, 64).to(torch.float16), None)


def _rounded_to_bf16(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(module.weight.to(torch.bfloat16).float())
    return model


@builds_here
@needs_onednn
def test_a_halved_model_sends_1_to_8_rows_to_the_bf16_copies_and_more_to_float32(kernel, one_thread):
    # What the halved model computes: a forward of more than 8 tokens on the float32 weights, one
    # of 1-8 on their bfloat16 values; the two plain models below take turns on one cache.
    full = build_llama(VOCAB, seed=5, hidden=64, layers=2)
    rounded = _rounded_to_bf16(build_llama(VOCAB, seed=5, hidden=64, layers=2))
    halved = build_llama(VOCAB, seed=5, hidden=64, layers=2)
    assert prepack_linears(halved, halved=True) > 0
    products = [m.product for m in halved.modules() if isinstance(m, PrepackedLinear)]
    assert all(p.half_weight is not None and p.half_weight.dtype == torch.bfloat16 for p in products)
    counter, layers = count_kernel_products(halved, kernel)
    feed_side_by_side(lambda tokens: full if tokens > small_rows_kernel.MAX_ROWS else rounded, halved, VOCAB)
    # 12 tokens go to oneDNN's float32 copy; 5, 1, 8 and 3 to the kernel on bfloat16, every layer.
    assert sorted(set(counter.calls)) == [(1, torch.bfloat16), (3, torch.bfloat16), (5, torch.bfloat16), (8, torch.bfloat16)]
    assert len(counter.calls) == 4 * layers


@builds_here
@needs_onednn
def test_with_gradients_or_more_threads_a_halved_layer_multiplies_its_float32_weight(kernel, one_thread):
    model = nn.Sequential(nn.Linear(64, 24))
    prepack_linears(model, halved=True)
    layer = model[0]
    x = torch.randn(3, 64, requires_grad=True)  # [3, in]
    assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    torch.set_num_threads(2)
    with torch.inference_mode():
        assert torch.equal(layer(x[:1]), nn.functional.linear(x[:1], layer.weight, layer.bias))  # torch's own, as unhalved


@needs_onednn
def test_without_the_kernel_nothing_is_halved():
    model = build_llama(VOCAB, seed=6, hidden=64, layers=1)
    prepack_linears(model, few_row_kernel=False, halved=True)
    assert all(m.product.half_weight is None for m in model.modules() if isinstance(m, PrepackedLinear))


@builds_here
@needs_onednn
def test_the_drafts_output_layer_gets_a_halved_product(kernel, one_thread):
    from specd.engine.draft_model import ReducedVocabHead

    head = ReducedVocabHead(hidden_size=16, draft_vocab_size=40, vocab_size=64)  # opts in: not an nn.Linear
    with torch.no_grad():
        head.weight.normal_()
    assert prepack_linears(head, halved=True) == 1
    x = torch.randn(2, 16)  # [2, H]
    with torch.inference_mode():
        got = head(x)  # [2, V]: -inf outside the head's 40 ids
    want = kernel.product(x, head.weight.detach().to(torch.bfloat16), None)  # [2, 40]
    assert torch.equal(got[:, head.token_ids], want)


@builds_here
@needs_onednn
@pytest.mark.parametrize("few_row_bf16", [True, False])
def test_the_draft_worker_halves_unless_told_not_to_and_the_target_worker_never(tiny_pair, kernel, one_thread, few_row_bf16):
    from draft_service.config import DraftConfig
    from draft_service.server import load_runner as load_draft
    from target_service.config import TargetConfig
    from target_service.worker import load_runner as load_target

    target, draft = tiny_pair
    draft_runner = load_draft(DraftConfig(model=draft, device="cpu", threads=1, few_row_bf16=few_row_bf16))
    target_runner = load_target(TargetConfig(model=target, device="cpu", threads=1))
    draft_products = [m.product for m in draft_runner.loaded.model.modules() if isinstance(m, PrepackedLinear)]
    target_products = [m.product for m in target_runner.loaded.model.modules() if isinstance(m, PrepackedLinear)]
    assert draft_products and target_products
    assert all((p.half_weight is not None) == few_row_bf16 for p in draft_products)
    assert all(p.half_weight is None for p in target_products)
    # Packed forwards of several sessions still serve the halved draft: its packing probe checks
    # the mechanism on float32 products, not the bfloat16 rounding of 1-8-row ones.
    assert draft_runner.packer is not None
    assert all((p.half_weight is not None) == few_row_bf16 for p in draft_products)  # and its copies are back


@builds_here
@needs_onednn
def test_a_one_thread_stack_writes_the_targets_greedy_output_in_every_mode(tiny_pair, kernel, one_thread):
    import specd.v1.coordinator_pb2 as pb

    target, draft = tiny_pair
    model, tokenizer = load_reference(target)
    prompt = tokenizer.encode("def add(a, b):\n    return a + b\n\ndef mul(a, b):\n", add_special_tokens=True)
    want = greedy_reference(model, prompt, 40)
    one = {"threads": 1}
    with running_stack(target, draft, draft_overrides=one, target_overrides=one) as stack:
        halved = [m.product for m in stack.draft.servicer.runner.loaded.model.modules() if isinstance(m, PrepackedLinear)]
        assert halved and all(p.half_weight is not None for p in halved)
        for mode in (pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_SSD):
            response = stack.stub().Generate(request(prompt, mode=mode, k=4, max_new_tokens=40), timeout=CALL_TIMEOUT_S)
            assert response.stats.mode == mode and not response.stats.fallback_reason
            assert_greedy_equal_or_near_tie(model, prompt, list(response.token_ids), want)
            assert mode == pb.SPECULATION_MODE_OFF or response.stats.accepted_tokens > 0
