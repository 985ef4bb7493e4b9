"""The draft recipe's evaluate stage on a prompts file (recipes/train_draft.py --prompts-file): a
string is a completion prompt, a list of messages a chat rendered with the target's template,
and each is continued greedily by the target to its end of turn."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

import torch  # noqa: E402
import train_draft  # noqa: E402

from tests.conftest import copy_target, greedy_reference, load_reference  # noqa: E402
from tests.small_drafts import moved_small_draft  # noqa: E402
from tests.tiny_models import build_llama  # noqa: E402

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
NEW_TOKENS = 6


def test_a_prompts_file_gives_code_and_chat_prompts_with_the_targets_greedy_continuations(tiny_pair, tmp_path):
    target, tokenizer = load_reference(copy_target(tiny_pair[0], tmp_path / "target", chat_template=TEMPLATE))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["import os\n", messages, "def main():\n"]))
    eos = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()

    continued = train_draft.file_continuations(prompts, target, tokenizer, NEW_TOKENS, eos)

    chat_text = "<system>Be brief.\n<user>def add(a, b):\n<assistant>"
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == chat_text
    want = {"code": ["import os\n", "def main():\n"], "chat": [chat_text]}
    assert set(continued) == set(want)
    for kind, texts in want.items():
        assert [prompt for prompt, _ in continued[kind]] == [tokenizer(text)["input_ids"] for text in texts]
        for prompt, continuation in continued[kind]:
            greedy = greedy_reference(target, prompt, NEW_TOKENS)
            ends = [i for i, token in enumerate(greedy) if token in eos]
            assert continuation == greedy[: ends[0] + 1 if ends else NEW_TOKENS]


def test_vocabulary_coverage_is_the_share_of_continuation_tokens_the_drafts_output_layer_holds():
    heldout = {"code": [([1, 2], [2, 4, 5]), ([3], [7])], "chat": [([9], [10, 12])]}  # prompt tokens do not count
    reduced = moved_small_draft(torch.arange(0, 4096, 2))  # the even ids only
    assert train_draft.vocab_coverage(reduced, heldout) == {"code": 0.5, "chat": 1.0}
    assert train_draft.vocab_coverage(build_llama(vocab_size=96, seed=1), heldout) == {"code": 1.0, "chat": 1.0}
