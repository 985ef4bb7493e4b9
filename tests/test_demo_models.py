"""The bundled demo pair (models/demo) loads like any HF checkpoint and shares a tokenizer."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DEMO = Path(__file__).resolve().parent.parent / "models" / "demo"
TARGET, DRAFT = DEMO / "target", DEMO / "draft"
SNIPPETS = [
    "def main(argv=None):\n    parser = argparse.ArgumentParser()\n",
    "import os\nimport sys\n\nclass Foo(object):\n    pass\n",
    "    for i, line in enumerate(lines):\n        if not line.strip():\n            continue\n",
    'raise ValueError("unexpected %r" % (value,))\n<|endoftext|>"""docstring"""',
]


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (TARGET / "config.json").exists() or not (DRAFT / "config.json").exists():
        pytest.skip("models/demo not present")
    torch.set_num_threads(1)
    out = {}
    for name, path in (("target", TARGET), ("draft", DRAFT)):
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[name] = (tok, model)
    return out


def test_files_and_size():
    for folder in (TARGET, DRAFT):
        for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"):
            assert (folder / name).is_file(), folder / name
    total = sum(f.stat().st_size for d in (TARGET, DRAFT) for f in d.iterdir() if f.is_file())
    assert total <= 60 * 1024 * 1024
    assert (TARGET / "tokenizer.json").read_bytes() == (DRAFT / "tokenizer.json").read_bytes()


def test_shared_tokenizer(pair):
    tok_t, model_t = pair["target"][0], pair["target"][1]
    tok_d, model_d = pair["draft"][0], pair["draft"][1]
    assert tok_t.get_vocab() == tok_d.get_vocab()
    assert len(tok_t) == 4096
    for s in SNIPPETS:
        ids = tok_t(s, add_special_tokens=False)["input_ids"]
        assert ids == tok_d(s, add_special_tokens=False)["input_ids"]
        assert tok_t.decode(ids) == s  # byte-level BPE round-trips exactly
    eot = tok_t.convert_tokens_to_ids("<|endoftext|>")
    assert tok_t.eos_token_id == tok_t.bos_token_id == tok_t.pad_token_id == eot
    assert tok_d.eos_token_id == eot
    assert model_t.get_output_embeddings().weight.shape[0] == model_d.get_output_embeddings().weight.shape[0]
    assert model_t.config.vocab_size == model_d.config.vocab_size == len(tok_t)
    assert model_t.config.max_position_embeddings >= 2048
    assert model_t.dtype == model_d.dtype == torch.float32


def test_greedy_generation(pair):
    prompt = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n"
    for name, (tok, model) in pair.items():
        enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            logits = model(**enc).logits
            assert torch.isfinite(logits).all(), name
            out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
        new = out[0, enc["input_ids"].shape[1]:]
        assert new.numel() > 0, name
        text = tok.decode(new, skip_special_tokens=True)
        assert text.strip(), (name, text)
        assert text.isprintable() or "\n" in text, (name, text)
