"""The one decoder-layer loop specd runs outside a model's own forward (the draft's lean forward,
specd/engine/lean_llama.py, and packed forwards, specd/engine/packed_forward.py): the model's own
modules, called in the order LlamaModel.forward calls them."""

from __future__ import annotations

import torch


def decoder_layers(model) -> list:
    """The layers a forward runs (a config may keep fewer than the module list holds)."""
    return list(model.model.layers[: model.config.num_hidden_layers])


def run_layers(
    model, layers: list, hidden: torch.Tensor, positions: torch.Tensor, cache, attention_mask=None, use_cache: bool = True, **layer_kwargs
) -> torch.Tensor:
    """hidden [1, L, H] (the embedded tokens) through the rotary embedding and every decoder layer;
    the hidden states before the final norm [1, L, H]. `positions` [1, L]; `cache` takes each layer's
    new keys and values; `layer_kwargs` go to every layer (a packed forward's batch)."""
    position_embeddings = model.model.rotary_emb(hidden, position_ids=positions)  # (cos, sin): [1, L, D]
    for layer in layers:
        hidden = layer(
            hidden,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            position_ids=positions,
            past_key_values=cache,
            use_cache=use_cache,
            **layer_kwargs,
        )
    return hidden
