"""Incremental detokenisation gives the text a whole decode gives, token by token."""

from __future__ import annotations

import pytest

from coordinator.text import TextAssembler
from specd.engine.default_pair import DEFAULT_TARGET
from specd.engine.loading import load_tokenizer

SAMPLES = [
    "def f(x):\n    return x  # ok\n",
    "héllo wörld — ✓ 日本語 🙂 done",
    "    if a:\n\tb = 'ü'\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_TARGET)


@pytest.mark.parametrize("sample", SAMPLES)
def test_incremental_text_equals_whole_decode(tokenizer, sample):
    prompt = tokenizer.encode("x = 1\n")
    ids = tokenizer.encode(sample)
    text = TextAssembler(tokenizer, prompt, [])
    for count, token in enumerate(ids, 1):
        assert not text.add(token)
        whole = tokenizer.decode(prompt + ids[:count], skip_special_tokens=True)[len(tokenizer.decode(prompt)) :]
        assert text.text.rstrip("\ufffd") == whole.rstrip("\ufffd")
        assert whole.startswith(text.text[: text.streamable_length()])
    assert text.text == sample


def test_stop_string_cuts_the_text(tokenizer):
    ids = tokenizer.encode("alpha beta gamma")
    text = TextAssembler(tokenizer, [], ["beta"])
    stopped = [text.add(t) for t in ids]
    assert any(stopped)
    assert text.text == "alpha " and text.stop_string == "beta"


def _byte_fallback_tokenizer():
    """A tokenizer of the Llama / Mistral kind: characters outside its vocabulary go as byte
    tokens, and its decoder shows each byte of an unfinished character as its own U+FFFD."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {c: 256 + i for i, c in enumerate("hix ")}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_a_stop_string_after_a_character_of_several_bytes_is_found():
    tokenizer = _byte_fallback_tokenizer()
    ids = tokenizer.encode("hi x😀 more", add_special_tokens=False)
    assert len(ids) > len("hi x more")  # the emoji went as its four bytes
    assert tokenizer.decode(ids[:6]) == "hi x\ufffd\ufffd"  # two of its bytes: two U+FFFD
    text = TextAssembler(tokenizer, [], ["x😀"])
    stopped = [text.add(t) for t in ids]
    assert stopped.index(True) == 7  # at the emoji's last byte
    assert text.text == "hi " and text.stop_string == "x😀"
