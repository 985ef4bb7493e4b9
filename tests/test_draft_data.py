"""The draft recipe's data (tools/draft_data.py): the batched prefill an accelerator uses gives
the same continuations and top-k log-probabilities as prefilling each prompt alone (the CPU's
way), and the target's self-written requests become chat prompts."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import draft_data  # noqa: E402
from tests.tiny_models import build_llama  # noqa: E402


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in (5, 17, 1, 11)]


def test_batched_prefill_matches_prefilling_each_prompt_alone():
    model = build_llama(vocab_size=96, seed=11).eval()
    prompts = _prompts(96)
    width = max(len(p) for p in prompts)
    with torch.inference_mode():
        alone_cache, alone_top, alone_last = draft_data._prefill_rows(model, prompts, width, topk=4)
        padded_cache, padded_top, padded_last = draft_data._prefill_padded(model, prompts, width, topk=4)
    torch.testing.assert_close(padded_last, alone_last, rtol=0, atol=1e-5)
    for (alone_values, alone_ids), (padded_values, padded_ids), ids in zip(alone_top, padded_top, prompts):
        assert padded_values.shape == (len(ids), 4)
        torch.testing.assert_close(padded_values, alone_values, rtol=0, atol=1e-5)
        assert torch.equal(padded_ids, alone_ids)
    for alone_layer, padded_layer in zip(alone_cache.layers, padded_cache.layers):
        torch.testing.assert_close(padded_layer.keys, alone_layer.keys, rtol=0, atol=1e-5)  # [B, heads, L, D], pads zero in both
        torch.testing.assert_close(padded_layer.values, alone_layer.values, rtol=0, atol=1e-5)


def test_continuations_are_the_same_with_either_prefill(monkeypatch):
    model = build_llama(vocab_size=96, seed=11).eval()
    prompts = _prompts(96)
    alone = draft_data.continue_batch(model, prompts, 12, 0.0, 1.0, 4, {0}, 0, seed=5)
    monkeypatch.setattr(draft_data, "_prefill_rows", draft_data._prefill_padded)
    padded = draft_data.continue_batch(model, prompts, 12, 0.0, 1.0, 4, {0}, 0, seed=5)
    for a, b, ids in zip(alone, padded, prompts):
        assert a["prompt_ids"] == b["prompt_ids"] == ids
        assert a["generated_ids"] == b["generated_ids"]
        assert a["top_logprobs"].shape == (len(ids) - 1 + len(a["generated_ids"]), 4)
        assert torch.equal(a["top_ids"], b["top_ids"])
        torch.testing.assert_close(a["top_logprobs"].float(), b["top_logprobs"].float(), rtol=0, atol=2e-3)


def test_a_continuation_ends_at_its_first_end_of_sequence_token():
    model = build_llama(vocab_size=96, seed=11).eval()
    prompts = _prompts(96)
    free = draft_data.continue_batch(model, prompts, 12, 0.0, 1.0, 2, set(), 0, seed=5)
    stop = free[1]["generated_ids"][3]  # the second prompt's 4th greedy token
    stopped = draft_data.continue_batch(model, prompts, 12, 0.0, 1.0, 2, {stop}, 0, seed=5)
    for before, after in zip(free, stopped):
        ids = before["generated_ids"]
        end = ids.index(stop) + 1 if stop in ids else len(ids)
        assert after["generated_ids"] == ids[:end]
        assert len(after["top_ids"]) == len(after["prompt_ids"]) - 1 + end


def _smollm2_tokenizer():
    from transformers import AutoTokenizer

    from specd.default_pair import DEFAULT_DRAFT

    return AutoTokenizer.from_pretrained(DEFAULT_DRAFT)  # the target's tokenizer files, committed with the draft


def test_a_user_turn_starts_where_the_template_puts_the_message():
    tokenizer = _smollm2_tokenizer()
    prefix = draft_data.user_turn_prefix(tokenizer)
    assert prefix.endswith("<|im_start|>user\n") and prefix.startswith("<|im_start|>system\n")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert rendered == prefix + "Hi<|im_end|>\n"


def test_self_written_requests_become_chat_prompts_and_the_unfinished_give_way(monkeypatch):
    tokenizer = _smollm2_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    request = "How do I sort a list of tuples by their second item?"
    written = [
        tokenizer(request)["input_ids"] + [end],  # a whole request
        tokenizer(" and then the model rambles on")["input_ids"],  # no end of turn within the limit
        tokenizer("Hi")["input_ids"] + [end],  # too short to be a request
    ]
    seen = {}

    def continue_batch(model, prompt_ids, new_tokens, temperature, top_p, topk, eos_ids, pad_id, seed):
        seen.update(prompts=prompt_ids, temperature=temperature, eos=eos_ids)
        return [{"generated_ids": ids} for ids in written]

    monkeypatch.setattr(draft_data, "continue_batch", continue_batch)
    definitions = draft_data.documented_definitions("textwrap", 'def dedent(text):\n    """Remove common leading whitespace."""\n    return text\n')
    prompts = [{"kind": "code", "text": "x = 1\n"}] + [{"kind": "self", "text": None} for _ in written]
    draft_data.write_self_chats(None, tokenizer, prompts, definitions, seed=3)
    assert seen["prompts"] == [tokenizer(draft_data.user_turn_prefix(tokenizer))["input_ids"]] * 3
    assert seen["temperature"] == 1.0 and seen["eos"] == {end}
    assert prompts[0] == {"kind": "code", "text": "x = 1\n"}
    assert prompts[1]["kind"] == "self"
    assert prompts[1]["text"] == tokenizer.apply_chat_template([{"role": "user", "content": request}], add_generation_prompt=True, tokenize=False)
    for fallback in prompts[2:]:
        text = fallback["text"]
        assert fallback["kind"] == "chat" and "<|im_start|>user\n" in text and text.endswith("<|im_start|>assistant\n")
        assert "dedent" in text or "leading whitespace" in text  # written from the stdlib definition
