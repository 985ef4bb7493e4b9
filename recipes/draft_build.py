"""A draft before training: the target's embedding and first layers borrowed, its own layers
started as copies of target layers, its head as the target's rows for the draft vocabulary."""

from __future__ import annotations

import json

import torch


def build_draft(args, vocab: torch.Tensor, trained_layers: int, init_layers: list[int]):
    """A draft before training: borrowed embedding and layers, trained layers and head from the target."""
    from specd.engine.default_target import NAME, target_folder
    from specd.engine.draft_model import DraftLlamaConfig, DraftLlamaForCausalLM, borrow_from_target

    target_config = json.loads((target_folder() / "config.json").read_text())
    for key in ("architectures", "model_type", "transformers_version", "_model_name_or_path", "tie_word_embeddings", "dtype"):
        target_config.pop(key, None)
    target_config["num_hidden_layers"] = args.borrowed_layers + trained_layers
    config = DraftLlamaConfig(draft_vocab_size=len(vocab), borrowed_layers=args.borrowed_layers, borrows_from=NAME, **target_config)
    torch.manual_seed(args.seed)
    draft = DraftLlamaForCausalLM(config).float()
    borrow_from_target(draft, str(target_folder()))
    init_from_target(draft, vocab, init_layers)
    draft.lm_head.token_ids.copy_(vocab)
    return draft


def layer_list(text: str) -> list[int]:
    return [int(i) for i in text.split(",")] if text else []


def init_from_target(draft, vocab: torch.Tensor, init_layers: list[int]) -> None:
    """Trained layers start as copies of the target's layers `init_layers`; norm and head as the target's."""
    from safetensors.torch import load_file

    from specd.engine.default_target import target_folder

    target = load_file(str(target_folder() / "model.safetensors"))
    state = draft.state_dict()
    with torch.no_grad():
        for offset, source in enumerate(init_layers):
            index = draft.config.borrowed_layers + offset
            for key, tensor in target.items():
                if key.startswith(f"model.layers.{source}."):
                    state[key.replace(f"layers.{source}.", f"layers.{index}.", 1)].copy_(tensor)
        state["model.norm.weight"].copy_(target["model.norm.weight"])
        state["lm_head.weight"].copy_(target["model.embed_tokens.weight"][vocab])  # tied in the target
