"""Tiny real models built in the test process: a BPE tokenizer, a Llama target, and drafts.

Weights are random but peaked (a large init range), so greedy decoding rarely meets
a near-tie; the draft is a perturbed copy of the target, so that its proposals are
accepted often but not always and every acceptance count 0..K occurs.
"""

from __future__ import annotations

import pathlib

import torch

EOS = "<|endoftext|>"

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding keeps outputs exact.\n",
    "while True:\n    line = stream.readline()\n    if not line:\n        break\n",
]


def build_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS, pad_token=EOS, unk_token=EOS
    )


def build_llama(vocab_size: int, seed: int, hidden: int = 64, layers: int = 2, init_range: float = 0.25, eos_id: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init_range,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def tree_step_inputs(config, vocab_size: int) -> list[dict]:
    """Keyword arguments of a draft tree's forwards: a 10-token prefix, then 3 steps of 4
    branches under the 4-D masks the draft worker builds (branch b sees the prefix up to
    6 + its root)."""
    from draft_service.tree_mask import TreeMasks

    prefix = torch.randint(1, vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))  # [1, 10]
    visible = 6 + torch.tensor([0, 2, 2, 3])  # [B]
    masks = TreeMasks(config, visible, 10, 3, torch.float32, "cpu")
    steps = [{"input_ids": prefix}]
    for step in range(1, 4):
        steps.append({
            "input_ids": torch.randint(1, vocab_size, (1, 4), generator=torch.Generator().manual_seed(step)),  # [1, B]
            "attention_mask": masks.at(step),
            "position_ids": (visible + step - 1).unsqueeze(0),  # [1, B]
        })
    return steps


def perturbed_copy(model, noise: float, seed: int):
    """The same architecture and weights plus Gaussian noise of `noise` times each tensor's std."""
    import copy

    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            if param.numel() > 1:
                scale = noise * float(param.std())
                param.add_(torch.randn(param.shape, generator=generator) * scale)
    return draft


def architecture_config(kind: str, vocab_size: int, eos_id: int):
    """A tiny config of another model family than Llama, each with what sets it apart:
    learned absolute positions (gpt2), partial rotary (gpt_neox), windowed and full layers
    mixed, with a window shorter than a request (qwen2), logit soft-capping and alternating
    windows (gemma2)."""
    import transformers

    ids = dict(vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, initializer_range=0.25)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)
    if kind == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **ids)
    if kind == "gpt_neox":
        return transformers.GPTNeoXConfig(rotary_pct=0.5, **shape, **ids)
    if kind == "qwen2":
        return transformers.Qwen2Config(
            num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=1, **shape, **ids
        )
    if kind == "gemma2":
        return transformers.Gemma2Config(num_key_value_heads=2, head_dim=16, sliding_window=16, **shape, **ids)
    raise ValueError(f"no tiny config for {kind}")


def save_pair(root: pathlib.Path, noise: float = 0.02, seed: int = 0, architecture: str = "llama") -> tuple[str, str]:
    """Write a target and a perturbed draft (same tokenizer) under root; return their folders."""
    tokenizer = build_tokenizer()
    if architecture == "llama":
        target = build_llama(len(tokenizer), seed=seed, eos_id=tokenizer.eos_token_id)
    else:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        target = AutoModelForCausalLM.from_config(architecture_config(architecture, len(tokenizer), tokenizer.eos_token_id)).eval()
    draft = perturbed_copy(target, noise, seed + 1)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        folder = root / name
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        paths.append(str(folder))
    return paths[0], paths[1]


def save_reduced_vocab_draft(folder: pathlib.Path, target_folder: str, draft_vocab_size: int, noise: float = 0.02, seed: int = 3) -> str:
    """A specd draft (specd/engine/draft_model.py) for the tiny Llama target: its first layer and
    embedding borrowed from the target, its second layer a perturbed copy of the target's, and
    an output layer over `draft_vocab_size` ids (every other id, so that tokens outside it
    are common) taken from the target's head rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specd.engine.draft_model import DraftLlamaConfig, DraftLlamaForCausalLM, borrow_from_target, save_draft

    target = AutoModelForCausalLM.from_pretrained(target_folder, dtype=torch.float32)
    settings = target.config.to_dict()
    for key in ("architectures", "model_type", "transformers_version", "tie_word_embeddings", "dtype"):
        settings.pop(key, None)
    config = DraftLlamaConfig(draft_vocab_size=draft_vocab_size, borrowed_layers=1, borrows_from=target_folder, **settings)
    draft = DraftLlamaForCausalLM(config).eval()
    borrow_from_target(draft, target_folder)
    token_ids = torch.arange(draft_vocab_size) * 2  # [N]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in target.model.layers[1].named_parameters():
            copied = draft.model.layers[1].get_parameter(name)
            copied.copy_(param + torch.randn(param.shape, generator=generator) * noise * float(param.std()))
        draft.model.norm.weight.copy_(target.model.norm.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight[token_ids])
        draft.lm_head.token_ids.copy_(token_ids)
    save_draft(draft, str(folder))
    AutoTokenizer.from_pretrained(target_folder).save_pretrained(folder)
    return str(folder)
