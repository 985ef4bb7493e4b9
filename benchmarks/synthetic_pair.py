"""A target and a draft of real shapes, with random weights and a realistic, known acceptance.

The default pair's GGUF file cannot travel to a machine without network, and a random target
writes no text a draft could predict. So the target here is a Llama of a real model's shape
whose first layers are ordinary random layers and whose later layers add only small random
residuals to what those compute (their output projections scaled down); the draft is those
first layers, the final norm and the head. The draft's distribution is then close to the
target's, not equal: how close is set by the scale (`--residual-scale`), and measured by the
bench's acceptance. The tokenizer is a word-level one over the whole vocabulary, so the head
keeps its real width on both (a draft worker drops embedding rows no token maps to).

    python benchmarks/synthetic_pair.py OUT [--shape llama-3.1-8b] [--draft-layers 2] [--device cuda] [--dtype bfloat16]

It also writes OUT/prompts.json, prompts of random words the tokenizer knows (`--prompts N`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

SHAPES = {
    # Llama-3.1-8B: 8.0 B parameters, 16 GB in bfloat16.
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    # A few MB, for a check on a CPU that the pair builds, saves and loads.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, rope_theta=10000.0),
}


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer with an id for every row of the vocabulary: w0 is the end of text,
    w1 stands for a word it does not know."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w1", eos_token="w0")


def word_prompts(vocab_size: int, count: int, words: int = 48, seed: int = 0) -> list[str]:
    """Prompts of random known words: the pair's tokenizer reads every one as a token of its own
    (text it does not know would be all w1, one repeated input)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab_size, (count, words), generator=generator)  # [count, words], no w0 or w1
    return [" ".join(f"w{i}" for i in row.tolist()) for row in ids]


def build_target(shape: str, draft_layers: int, residual_scale: float, dtype: torch.dtype, device: str, seed: int):
    """The target: `draft_layers` ordinary random layers, the rest adding residuals scaled by `residual_scale`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # No pad id: a padding row is initialised to zeros, and a pair without one needs none.
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=None)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype where it runs: no float32 copy of 8 B weights
    try:
        with torch.device(device):
            target = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for layer in target.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(residual_scale)
            layer.mlp.down_proj.weight.mul_(residual_scale)
    return target


def draft_of(target, draft_layers: int):
    """The draft: the target's embedding, first `draft_layers` layers, final norm and head."""
    from transformers import LlamaForCausalLM

    config = target.config.__class__(**{**target.config.to_dict(), "num_hidden_layers": draft_layers})
    with torch.device("meta"):
        draft = LlamaForCausalLM(config)
    kept = {k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < draft_layers}
    draft.load_state_dict(kept, assign=True)
    draft.model.rotary_emb = target.model.rotary_emb  # its buffers are not in the state dict
    return draft.eval()


def save_pair(out: pathlib.Path, shape: str, draft_layers: int, residual_scale: float, dtype: torch.dtype,
              device: str, seed: int = 0) -> tuple[str, str]:
    """Build both and save them, with the tokenizer, under out/target and out/draft."""
    target = build_target(shape, draft_layers, residual_scale, dtype, device, seed)
    tokenizer = word_tokenizer(target.config.vocab_size)
    folders = []
    for name, model in (("target", target), ("draft", draft_of(target, draft_layers))):
        folder = out / name
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders.append(str(folder))
    return folders[0], folders[1]


def greedy_smoke(target_folder: str, max_new_tokens: int = 8) -> list[int]:
    """The saved target's greedy tokens after a word prompt, in this process on the CPU: a pair a
    bench can measure writes more than an end of text."""
    from specd.engine.loading import load_causal_lm

    loaded = load_causal_lm(target_folder, device="cpu")
    ids = loaded.tokenizer(word_prompts(loaded.vocab_size, 1)[0], return_tensors="pt").input_ids  # [1, P]
    with torch.inference_mode():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="folder to write target/ and draft/ into")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b", help="the target's shape (default: %(default)s)")
    parser.add_argument("--draft-layers", type=int, default=2, help="the target's first layers the draft keeps (default: %(default)s)")
    parser.add_argument("--residual-scale", type=float, default=0.1,
                        help="scale of the later layers' output projections: smaller, higher acceptance (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="where the weights are made (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", help="the weights' dtype (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=8, help="word prompts written to OUT/prompts.json (default: %(default)s)")
    args = parser.parse_args()
    target, draft = save_pair(args.out, args.shape, args.draft_layers, args.residual_scale, getattr(torch, args.dtype), args.device)
    prompts = args.out / "prompts.json"
    prompts.write_text(json.dumps(word_prompts(SHAPES[args.shape]["vocab_size"], args.prompts)))
    print(f"target {target}\ndraft {draft}\nprompts {prompts}")


if __name__ == "__main__":
    main()
