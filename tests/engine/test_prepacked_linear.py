"""specd/engine/backends/cpu_kernels/prepacked_linear.py: a model with prepacked linear layers computes what it computed before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specd.engine.backends.cpu_kernels import prepacked_linear
from specd.engine.backends.cpu_kernels.prepacked_linear import PrepackedLinear, prepack_linears
from specd.engine.kv_cache import GrowingKVCache
from tests.cpu_products import needs_onednn
from tests.tiny_models import build_llama

VOCAB = 96


def _linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Linear, PrepackedLinear))]


def _logits(model, feeds: list[torch.Tensor]) -> list[torch.Tensor]:
    cache = GrowingKVCache()
    with torch.inference_mode():
        return [model(input_ids=ids, past_key_values=cache, use_cache=True).logits for ids in feeds]


@needs_onednn
def test_every_linear_is_replaced_and_the_weights_stay_the_same_parameters():
    model = build_llama(VOCAB, seed=3, hidden=32, layers=2)
    before = {name: p for name, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    count = len(_linears(model))

    assert prepack_linears(model) == count == 2 * 7 + 1  # q k v o gate up down per layer, the output layer
    assert all(type(m) is PrepackedLinear for m in _linears(model))
    assert {name: p for name, p in model.named_parameters()}.keys() == before.keys()
    assert all(p is before[name] for name, p in model.named_parameters())
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)


@needs_onednn
def test_a_tied_output_layer_keeps_the_embedding_as_its_weight():
    model = build_llama(VOCAB, seed=4, hidden=32, layers=1)
    model.lm_head.weight = model.model.embed_tokens.weight  # tie them, as SmolLM2 is
    prepack_linears(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@needs_onednn
def test_forwards_of_several_tokens_agree_to_rounding_and_a_lone_token_is_bitwise():
    plain = build_llama(VOCAB, seed=5, hidden=64, layers=2)
    packed = build_llama(VOCAB, seed=5, hidden=64, layers=2)
    prepack_linears(packed, few_row_kernel=False)  # oneDNN's products alone (the kernel's: tests/engine/test_small_rows_kernel.py)
    generator = torch.Generator().manual_seed(0)
    feeds = [torch.randint(1, VOCAB, (1, n), generator=generator) for n in (12, 5, 1, 1, 9)]  # [1, n] each

    for index, (want, got) in enumerate(zip(_logits(plain, feeds), _logits(packed, feeds))):
        assert torch.allclose(want, got, rtol=1e-4, atol=1e-4), f"forward {index}"
        assert want.argmax(-1).equal(got.argmax(-1)), f"forward {index}"
    # One token on an empty cache: every product has one row, which without the kernel torch's own product serves.
    lone = feeds[2]  # [1, 1]
    assert torch.equal(_logits(plain, [lone])[0], _logits(packed, [lone])[0])


@needs_onednn
def test_a_batch_of_sessions_takes_the_packed_product():
    plain = build_llama(VOCAB, seed=6, hidden=64, layers=1)
    packed = build_llama(VOCAB, seed=6, hidden=64, layers=1)
    prepack_linears(packed)
    ids = torch.randint(1, VOCAB, (3, 4), generator=torch.Generator().manual_seed(1))  # [3, 4]
    with torch.inference_mode():
        want, got = plain(input_ids=ids).logits, packed(input_ids=ids).logits  # [3, 4, V]
    assert got.shape == want.shape and torch.allclose(want, got, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_with_gradients_the_layer_is_an_ordinary_linear():
    layer = nn.Linear(16, 8)
    packed = PrepackedLinear(layer)
    x = torch.randn(4, 16, requires_grad=True)  # [4, 16]
    out = packed(x)  # [4, 8]
    assert torch.equal(out, nn.functional.linear(x, layer.weight, layer.bias))
    out.sum().backward()
    assert layer.weight.grad is not None and x.grad is not None


@needs_onednn
def test_a_module_that_opts_in_gets_a_packed_product_of_its_weight():
    class Head(nn.Module):  # not an nn.Linear: a product of `weight` it takes its own way
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(40, 16))  # [out, in]
            self.product = None

        def use_packed_product(self, product):
            self.product = product

    head = Head()
    assert prepack_linears(head, few_row_kernel=False) == 1
    assert head.product.weight is head.weight
    x = torch.randn(2, 3, 16)  # [2, 3, in]: six rows
    with torch.inference_mode():
        got = head.product(x)  # [2, 3, out]
    assert got.shape == (2, 3, 40) and torch.allclose(got, x @ head.weight.T, rtol=1e-4, atol=1e-5)
    assert torch.equal(head.product(x[:1, :1]), nn.functional.linear(x[:1, :1], head.weight))  # one row, no kernel: torch's

    hooked = Head()
    hooked.register_forward_pre_hook(lambda module, args: None)
    assert prepack_linears(hooked) == 0 and hooked.product is None


def test_layers_it_cannot_serve_are_left_alone():
    model = build_llama(VOCAB, seed=7, hidden=32, layers=1).to(torch.bfloat16)
    assert prepack_linears(model) == 0
    assert not any(type(m) is PrepackedLinear for m in model.modules())

    hooked = build_llama(VOCAB, seed=7, hidden=32, layers=1)
    hooked.lm_head.register_forward_hook(lambda module, args, out: out)
    prepack_linears(hooked)
    assert type(hooked.lm_head) is nn.Linear


@needs_onednn
def test_a_packed_product_that_disagrees_leaves_the_model_as_it_was(monkeypatch):
    product = prepacked_linear._packed_product
    monkeypatch.setattr(prepacked_linear, "_packed_product", lambda x, packed, bias: product(x, packed, bias) + 1e-3)
    model = build_llama(VOCAB, seed=8, hidden=32, layers=1)
    assert prepack_linears(model) == 0
    assert all(type(m) is nn.Linear for m in _linears(model))


@needs_onednn
@pytest.mark.parametrize("prepack", [True, False])
def test_the_workers_prepack_unless_told_not_to(tiny_pair, prepack):
    from draft_service.config import DraftConfig
    from draft_service.server import load_runner as load_draft
    from target_service.config import TargetConfig
    from target_service.worker import load_runner as load_target

    target, draft = tiny_pair
    runners = [
        load_target(TargetConfig(model=target, device="cpu", prepack_weights=prepack)),
        load_draft(DraftConfig(model=draft, device="cpu", prepack_weights=prepack)),
    ]
    for runner in runners:
        assert any(type(m) is PrepackedLinear for m in runner.loaded.model.modules()) == prepack
