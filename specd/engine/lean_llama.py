"""A Llama forward without transformers' per-call wrappers, for the draft worker.

A draft model is small (a few layers), so a tree step's time is mostly the
Python around the arithmetic, not the arithmetic: output capturing, config defaults, mask
creation, output dataclasses. LeanLlama calls the model's own modules (embedding, rotary
embedding, decoder layers, final norm, LM head) in the order LlamaModel.forward does and
skips the rest. A caller-given 4-D mask (the speculation tree's) is passed to the layers as
is; otherwise the causal mask comes from transformers' own create_causal_mask. Before it is
used, a probe checks that it gives bitwise the logits model(...) gives; when it does not
(another transformers version, another Llama variant) the model's own forward serves.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from transformers.masking_utils import create_causal_mask

from specd.engine.forward_probe import same_logits
from specd.engine.llama_layers import decoder_layers, run_layers

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LeanOutput:
    logits: torch.Tensor  # [1, kept, V]


class LeanLlama:
    """Stands in for a LlamaForCausalLM in forward calls: the keyword arguments specd passes,
    plus `device`, `config` and `parameters()`."""

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self._inner = model.model
        self._layers = decoder_layers(model)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def parameters(self):
        return self.model.parameters()

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,  # [1, L]
        past_key_values,
        attention_mask: torch.Tensor | None = None,  # [1, 1, L, cached + L] additive, or None: causal
        position_ids: torch.Tensor | None = None,  # [1, L]
        logits_to_keep: int = 0,
        use_cache: bool = True,
    ) -> LeanOutput:
        inner = self._inner
        hidden = inner.embed_tokens(input_ids)  # [1, L, H]
        if position_ids is None:
            cached = past_key_values.get_seq_length()
            position_ids = (torch.arange(input_ids.shape[1], device=hidden.device) + cached).unsqueeze(0)  # [1, L]
        if attention_mask is None and input_ids.shape[1] > 1:
            attention_mask = create_causal_mask(
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=None,
                past_key_values=past_key_values,
                position_ids=position_ids,
            )
        hidden = run_layers(self.model, self._layers, hidden, position_ids, past_key_values, attention_mask, use_cache)
        hidden = inner.norm(hidden)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]  # [1, kept, H]
        return LeanOutput(logits=self.model.lm_head(hidden))


def lean_or_plain(model):
    """LeanLlama over `model` where it is a LlamaForCausalLM and the probe agrees; else `model`."""
    from transformers import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):  # specd's draft (specd/engine/draft_model.py) is one too
        return model
    lean = LeanLlama(model)
    if not same_logits(model, lean, model.config.vocab_size, model.device):
        log.warning("the lean Llama forward differs from %s's own here; using the model's forward", type(model).__name__)
        return model
    log.info("serving %s through the lean Llama forward", type(model).__name__)
    return lean
