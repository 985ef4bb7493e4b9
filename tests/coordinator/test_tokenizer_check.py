"""The coordinator refuses a draft whose tokenizer maps strings to other ids than the target's."""

from __future__ import annotations

import pytest

from coordinator.server import TokenizerMismatch
from tests.stack import ServiceStack
from tests.tiny_models import build_llama, build_tokenizer


def test_draft_with_another_tokenizer_stops_the_coordinator(tiny_pair, tmp_path):
    target, _ = tiny_pair
    other_tokenizer = build_tokenizer(vocab_size=320)  # same family of merges, different ids past 320
    other_draft = build_llama(len(other_tokenizer), seed=5, eos_id=other_tokenizer.eos_token_id)
    folder = tmp_path / "other-draft"
    other_draft.save_pretrained(folder)
    other_tokenizer.save_pretrained(folder)

    stack = ServiceStack(target, str(folder))
    try:
        with pytest.raises(TokenizerMismatch, match="different token ids"):
            stack.start()
    finally:
        stack.close()
