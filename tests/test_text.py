"""Incremental detokenisation gives the text a whole decode gives, token by token."""

from __future__ import annotations

import pytest

from coordinator.text import TextAssembler
from specd.default_pair import DEFAULT_TARGET
from specd.models import load_tokenizer

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
