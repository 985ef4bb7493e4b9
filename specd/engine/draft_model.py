"""specd's draft model: a Llama that borrows its target's embedding and first layers and
predicts only a reduced vocabulary.

What the committed folder holds is small: the draft's own decoder layers, its final norm and an
output layer over the N tokens the target emits most (`draft_vocab`), in bf16. What it borrows
from the target is named in its config (`borrows_from`, resolved by `specd.engine.default_target` for
the default pair) and read from the target's weights at load time, frozen: the token embedding
(57 MB in bf16, too big to commit twice) and the target's first `borrowed_layers` decoder
layers, which compute exactly what they compute inside the target.

The output layer's logits are scattered into the full vocabulary with -inf elsewhere, so every
caller sees ordinary [..., V] logits: q is zero outside the draft vocabulary, which the ratio
test handles exactly, and the sparse wire never carries those tokens.
"""

from __future__ import annotations

import pathlib
import re

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

MODEL_TYPE = "specd_draft_llama"


class DraftLlamaConfig(LlamaConfig):
    model_type = MODEL_TYPE

    def __init__(self, draft_vocab_size: int = 8192, borrowed_layers: int = 0, borrows_from: str = "", **kwargs):
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)
        self.draft_vocab_size = draft_vocab_size
        self.borrowed_layers = borrowed_layers  # the target's first layers, loaded from it, frozen
        self.borrows_from = borrows_from  # which target: a name specd.engine.default_target resolves, or a folder


class ReducedVocabHead(torch.nn.Module):
    """Logits over `token_ids` only, returned as full-vocabulary logits with -inf elsewhere."""

    def __init__(self, hidden_size: int, draft_vocab_size: int, vocab_size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(draft_vocab_size, hidden_size))  # [N, H]
        self.register_buffer("token_ids", torch.arange(draft_vocab_size), persistent=True)  # [N]
        self.vocab_size = vocab_size
        self._product = None  # a PackedProduct of `weight`, once specd.engine.backends.cpu_kernels.prepacked_linear hands one over

    def use_packed_product(self, product) -> None:
        """Take products of several rows on a prepacked copy of the weight (specd.engine.backends.cpu_kernels.prepacked_linear)."""
        self._product = product

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        product = self._product
        reduced = product(hidden) if product is not None else F.linear(hidden, self.weight)  # [..., N]
        full = reduced.new_full((*reduced.shape[:-1], self.vocab_size), float("-inf"))  # [..., V]
        return full.index_copy_(-1, self.token_ids, reduced)


class DraftLlamaForCausalLM(LlamaForCausalLM):
    config_class = DraftLlamaConfig
    _tied_weights_keys = {}

    def __init__(self, config: DraftLlamaConfig):
        super().__init__(config)
        self.lm_head = ReducedVocabHead(config.hidden_size, config.draft_vocab_size, config.vocab_size)
        self.post_init()
        # A committed draft lacks the borrowed weights on purpose: not worth a "missing keys" warning.
        self._keys_to_ignore_on_load_missing = {f"^{re.escape(key)}$" for key in self.borrowed_state_keys()}

    def borrowed_state_keys(self) -> list[str]:
        """The parameters read from the target: its embedding and first layers."""
        keys = ["model.embed_tokens.weight"]
        for name, _ in self.named_parameters():
            if name.startswith("model.layers."):
                if int(name.split(".")[2]) < self.config.borrowed_layers:
                    keys.append(name)
        return keys


AutoConfig.register(MODEL_TYPE, DraftLlamaConfig)
AutoModelForCausalLM.register(DraftLlamaConfig, DraftLlamaForCausalLM)


def borrow_from_target(model: DraftLlamaForCausalLM, target_folder: str) -> None:
    """Copy the embedding and first layers from the target's safetensors into `model`."""
    from safetensors import safe_open

    files = sorted(pathlib.Path(target_folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"the draft borrows from {target_folder}, which holds no *.safetensors")
    wanted = set(model.borrowed_state_keys())
    state = model.state_dict()
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in wanted & set(handle.keys()):
                tensor = handle.get_tensor(key)
                if tensor.shape != state[key].shape:
                    raise ValueError(f"{key}: the target's is {tuple(tensor.shape)}, the draft expects {tuple(state[key].shape)}")
                with torch.no_grad():
                    state[key].copy_(tensor.to(state[key].dtype))
                wanted.discard(key)
    if wanted:
        raise ValueError(f"the target at {target_folder} lacks {sorted(wanted)[:3]}: it is not the model this draft was trained for")


def save_draft(model: DraftLlamaForCausalLM, folder: str) -> None:
    """The draft's config and its own weights in bf16 (the token ids as they are): what is committed.
    The borrowed embedding and layers are left out; they are the target's."""
    from safetensors.torch import save_file

    borrowed = set(model.borrowed_state_keys())
    own = {}
    for key, tensor in model.state_dict().items():
        if key not in borrowed:
            own[key] = (tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor).contiguous()
    pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
    save_file(own, str(pathlib.Path(folder) / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)

