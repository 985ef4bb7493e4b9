"""specd/engine/backends/cpu_kernels/grouped_attention.py: query heads attend in groups on their shared key/value heads,
bitwise as transformers' sdpa does on copies of them."""

from __future__ import annotations

import pytest
import torch

import specd.engine.backends.cpu_kernels.grouped_attention as grouped
from specd.engine.backends.cpu_kernels.grouped_attention import GROUPED_SDPA, use_grouped_attention
from specd.engine.kv_cache import GrowingKVCache
from specd.engine.packed_forward import Segment, enable_packing
from tests.tiny_models import build_llama, tree_step_inputs

VOCAB = 96


def _grouped_model(seed: int = 5):
    """A tiny Llama with 4 query heads on 2 key/value heads, switched to grouped attention."""
    model = build_llama(VOCAB, seed=seed, hidden=32, layers=2)
    assert use_grouped_attention(model)
    assert model.config._attn_implementation == GROUPED_SDPA
    return model


def _logits_under(model, attention: str, steps: list[dict]) -> list[torch.Tensor]:
    """Each step's logits under `attention`, on a fresh cache."""
    model.config._attn_implementation_internal = attention
    cache = GrowingKVCache()
    with torch.inference_mode():
        return [model(past_key_values=cache, use_cache=True, **kwargs).logits for kwargs in steps]  # [1, n, V] each


def _grouped_calls(monkeypatch) -> list[tuple[int, int]]:
    """Records (query heads, key/value heads) of every torch sdpa call given a mask and grouped
    heads (transformers' own sdpa hands torch grouped heads only without a mask)."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(query, key, value, *args, **kwargs):
        if kwargs.get("enable_gqa") and kwargs.get("attn_mask") is not None:
            calls.append((query.shape[1], key.shape[1]))
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(grouped.torch.nn.functional, "scaled_dot_product_attention", counting)
    return calls


def test_verify_steps_on_a_cache_match_sdpa_bitwise_without_copying_heads(monkeypatch):
    model = _grouped_model()
    generator = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(1, VOCAB, (1, n), generator=generator)  # noqa: E731  [1, n]
    steps = [{"input_ids": ids(11)}, {"input_ids": ids(5)}, {"input_ids": ids(1)}, {"input_ids": ids(3), "logits_to_keep": 3}]
    calls = _grouped_calls(monkeypatch)
    want = _logits_under(model, "sdpa", steps)
    assert calls == []  # transformers' sdpa copied the heads for the masked steps
    got = _logits_under(model, GROUPED_SDPA, steps)
    for index, (w, g) in enumerate(zip(want, got)):
        assert torch.equal(w, g), f"step {index}"
    # The two masked steps of several tokens, in both layers, ran grouped: 4 query heads on 2.
    assert calls == [(4, 2)] * 4


def test_tree_steps_with_a_4d_mask_match_sdpa_bitwise():
    model = _grouped_model(seed=6)
    steps = tree_step_inputs(model.config, VOCAB)
    for index, (w, g) in enumerate(zip(_logits_under(model, "sdpa", steps), _logits_under(model, GROUPED_SDPA, steps))):
        assert torch.equal(w, g), f"step {index}"


def test_packed_forwards_attend_in_groups():
    model = _grouped_model(seed=7)
    packer = enable_packing(model)
    assert packer is not None and packer.base_attention == GROUPED_SDPA
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in (6, 4)]
    steps = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in (3, 2)]
    lone, packed = [GrowingKVCache(), GrowingKVCache()], [GrowingKVCache(), GrowingKVCache()]
    with torch.inference_mode():
        for feeds in (prompts, steps):
            want = [model(input_ids=torch.tensor([f]), past_key_values=c, use_cache=True).logits[0] for f, c in zip(feeds, lone)]
            got, _ = packer.forward([Segment(c, f, len(f)) for f, c in zip(feeds, packed)])
            for w, g in zip(want, got):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert model.config._attn_implementation == GROUPED_SDPA  # restored after each packed forward


def test_only_models_with_grouped_heads_on_sdpa_switch():
    from transformers import LlamaConfig, LlamaForCausalLM

    ungrouped = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
    )).eval()
    assert not use_grouped_attention(ungrouped)
    assert ungrouped.config._attn_implementation == "sdpa"
    eager = build_llama(VOCAB, seed=8, hidden=32, layers=1)
    eager.config._attn_implementation_internal = "eager"
    assert not use_grouped_attention(eager)
    assert eager.config._attn_implementation == "eager"


def test_a_probe_that_disagrees_keeps_the_models_attention(monkeypatch):
    model = build_llama(VOCAB, seed=9, hidden=32, layers=1)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def off_by_a_bit(query, key, value, *args, **kwargs):
        output = sdpa(query, key, value, *args, **kwargs)
        return output + 1e-6 if kwargs.get("enable_gqa") else output

    monkeypatch.setattr(grouped.torch.nn.functional, "scaled_dot_product_attention", off_by_a_bit)
    assert not use_grouped_attention(model)
    assert model.config._attn_implementation == "sdpa"


def test_a_torch_without_grouped_heads_under_a_mask_keeps_the_models_attention(monkeypatch):
    model = build_llama(VOCAB, seed=10, hidden=32, layers=1)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def no_gqa(query, key, value, *args, enable_gqa=False, **kwargs):
        if enable_gqa and kwargs.get("attn_mask") is not None:
            raise RuntimeError("grouped heads under a mask are not supported")
        return sdpa(query, key, value, *args, enable_gqa=enable_gqa, **kwargs)

    monkeypatch.setattr(grouped.torch.nn.functional, "scaled_dot_product_attention", no_gqa)
    assert not use_grouped_attention(model)
    assert model.config._attn_implementation == "sdpa"
    with torch.inference_mode():  # and it still serves
        model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=GrowingKVCache(), use_cache=True)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_workers_serve_grouped_attention_unless_turned_off(role, tmp_path):
    from draft_service.config import DraftConfig
    from draft_service.server import load_runner as load_draft
    from target_service.config import TargetConfig
    from target_service.worker import load_runner as load_target
    from tests.tiny_models import save_pair

    target_dir, draft_dir = save_pair(tmp_path)
    if role == "target":
        runner = lambda **settings: load_target(TargetConfig(model=target_dir, **settings))  # noqa: E731
    else:
        runner = lambda **settings: load_draft(DraftConfig(model=draft_dir, **settings))  # noqa: E731
    assert runner().loaded.model.config._attn_implementation == GROUPED_SDPA
    assert runner(grouped_attention=False).loaded.model.config._attn_implementation == "sdpa"


def test_what_transformers_sdpa_does_with_a_softcap_it_still_does():
    """A softcap goes to transformers' own sdpa attention, whatever that does with it (recent
    versions refuse it, older ones ignore it): grouped attention never computes it differently."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = build_llama(VOCAB, seed=12, hidden=32, layers=1)
    attention = model.model.layers[0].self_attn
    query = torch.randn(1, 4, 3, 8)  # [B, heads, L, D]
    key = value = torch.randn(1, 2, 5, 8)  # [B, kv_heads, S, D]
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)

    def outcome(attend):
        try:
            return attend(attention, query, key, value, mask, softcap=30.0)[0]
        except ValueError as error:
            return str(error)

    theirs, ours = outcome(sdpa_attention_forward), outcome(grouped.grouped_sdpa_attention)
    assert type(theirs) is type(ours)
    assert ours == theirs if isinstance(ours, str) else torch.equal(ours, theirs)
