"""Grouped-query attention without copying the keys and values, on a CPU.

In a model with fewer key/value heads than query heads (SmolLM2: 9 query heads, 3 key/value
heads), transformers' sdpa attention hands torch the groups only when there is no mask; with
one, and more than one query, it first repeats every key and value head for each query head
of its group (`repeat_kv`), a copy of the whole cache per layer and forward. A verify of
several tokens on a cache, and a draft tree's step, always carry a mask. torch's sdpa takes
the groups itself (`enable_gqa`), with a mask too, and on a CPU computes bitwise what it
computes on the repeated heads, without the copy.

`use_grouped_attention(model)` switches a model whose attention is transformers' sdpa to
this one when a probe (a prefill, then a masked step of several tokens, then one token)
gives bitwise the logits the model's own sdpa gives; otherwise the model keeps its
attention. On an accelerator the model keeps it too: there torch runs grouped heads under a
mask on its slow math kernel.
"""

from __future__ import annotations

import logging

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from specd.engine.forward_probe import same_logits

log = logging.getLogger(__name__)

GROUPED_SDPA = "specd_grouped_sdpa"


def grouped_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa attention, with grouped heads under a mask left grouped.

    query: [B, heads, L, D]; key, value: [B, kv_heads, S, D]; returns ([B, L, heads, D], None)
    as transformers' attention functions do. Every other case is transformers' own function.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    plain = groups == 1 or attention_mask is None or query.shape[2] == 1
    if plain or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # [B, heads, L, D]
    return output.transpose(1, 2).contiguous(), None  # [B, L, heads, D]


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
# The masks sdpa gets; an attention transformers has no mask function for gets no mask at all.
ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_SDPA, sdpa_mask)


def use_grouped_attention(model) -> bool:
    """Switch `model` (a CPU model on transformers' sdpa attention, with grouped heads) to
    grouped_sdpa_attention if the probe agrees; True if it did."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa" or model.device.type != "cpu":
        return False
    heads = getattr(config, "num_attention_heads", None)
    if not heads or getattr(config, "num_key_value_heads", heads) == heads:
        return False
    try:
        agrees = _agrees(model)
    except (RuntimeError, TypeError) as error:  # a torch whose sdpa cannot take grouped heads under a mask
        log.warning("grouped attention does not run here (%s): %s keeps its attention", error, type(model).__name__)
        agrees = False
    else:
        if agrees:
            log.info("%s's query heads attend in groups on their shared key/value heads", type(model).__name__)
        else:
            log.warning("grouped attention differs from the model's own sdpa here: %s keeps its attention", type(model).__name__)
    config._attn_implementation_internal = GROUPED_SDPA if agrees else "sdpa"
    return agrees


def _agrees(model) -> bool:
    """The model's forward under this attention against under transformers' sdpa (same_logits)."""
    config = model.config

    def under(attention: str):
        def forward(**inputs):
            config._attn_implementation_internal = attention
            return model(**inputs)

        return forward

    try:
        return same_logits(under("sdpa"), under(GROUPED_SDPA), config.vocab_size, model.device)
    finally:
        config._attn_implementation_internal = "sdpa"
