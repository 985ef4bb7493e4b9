"""The draft recipe's data (recipes/draft_data.py): the batched prefill an accelerator uses gives
the same continuations and top-k log-probabilities as prefilling each prompt alone (the CPU's
way), and the target's self-written requests become chat prompts."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

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
    lengths = []
    for before, after in zip(free, stopped):
        ids = before["generated_ids"]
        end = ids.index(stop) + 1 if stop in ids else len(ids)
        assert after["generated_ids"] == ids[:end]
        assert len(after["top_ids"]) == len(after["prompt_ids"]) - 1 + end
        # Rows that ended left the batch: the rows still going kept their own caches.
        assert torch.equal(after["top_ids"], before["top_ids"][: len(after["top_ids"])])
        torch.testing.assert_close(after["top_logprobs"].float(), before["top_logprobs"][: len(after["top_ids"])].float(), rtol=0, atol=2e-3)
        lengths.append(end)
    assert min(lengths) < 12 and max(lengths) == 12  # some rows ended while others went on


def test_a_sampled_continuation_ends_rows_and_goes_on_with_the_rest():
    model = build_llama(vocab_size=96, seed=11).eval()
    prompts = _prompts(96)
    free = draft_data.continue_batch(model, prompts, 16, 1.0, 0.9, 2, set(), 0, seed=5)
    first = [row["generated_ids"][0] for row in free]
    stopped = draft_data.continue_batch(model, prompts, 16, 1.0, 0.9, 2, {first[0]}, 0, seed=5)
    assert stopped[0]["generated_ids"] == [first[0]]  # the same first draw, which ends the row
    for row, ids in zip(stopped, prompts):
        generated = row["generated_ids"]
        assert row["prompt_ids"] == ids and 1 <= len(generated) <= 16
        assert first[0] not in generated[:-1]  # a row ends at its first end-of-sequence token
        assert len(row["top_ids"]) == len(ids) - 1 + len(generated)


def _smollm2_tokenizer():
    from transformers import AutoTokenizer

    from specd.engine.default_pair import DEFAULT_DRAFT

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


def _nucleus_by_hand(probs: list[float], top_p: float) -> set[int]:
    """The likeliest tokens, in order, up to the first whose mass before it exceeds top_p."""
    kept, mass = set(), 0.0
    for token in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if mass > top_p:
            break
        kept.add(token)
        mass += probs[token]
    return kept


def test_the_nucleus_keeps_the_likeliest_tokens_up_to_top_p():
    generator = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(6, 40, generator=generator) * torch.tensor([0.5, 1, 2, 3, 4, 6])[:, None], dim=-1)  # [6, 40]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    weights = draft_data.nucleus(sorted_probs, 0.8)  # [6, 40]
    for row in range(6):
        kept = {int(order[row, i]) for i in range(40) if weights[row, i] > 0}
        assert kept == _nucleus_by_hand(probs[row].tolist(), 0.8)
        assert torch.equal(weights[row][weights[row] > 0], sorted_probs[row][weights[row] > 0])


def test_sampling_among_candidates_draws_from_the_whole_sorts_nucleus():
    vocab, rows, top_p = 64, 4000, 0.9
    peaked = torch.full((vocab,), -8.0)
    peaked[[5, 17, 40]] = torch.tensor([2.0, 1.5, 1.0])  # the nucleus lies among the 8 candidates
    flat = torch.linspace(0.0, 0.5, vocab)  # the nucleus reaches far past them: the row is sorted whole
    logits = torch.cat([peaked.expand(rows, vocab), flat.expand(rows, vocab)])  # [2R, V]
    drawn = draft_data.choose_next(logits, 1.0, top_p, torch.Generator().manual_seed(9), candidates=8)  # [2R]
    for half, row_logits in ((drawn[:rows], peaked), (drawn[rows:], flat)):
        probs = torch.softmax(row_logits, dim=-1)
        kept = sorted(_nucleus_by_hand(probs.tolist(), top_p))
        assert set(half.tolist()) <= set(kept)
        expected = probs[kept] / probs[kept].sum()
        observed = torch.bincount(half, minlength=vocab)[kept].float() / rows
        assert (observed - expected).abs().max() < 0.03
    assert len(set(drawn[rows:].tolist())) > 8  # the flat rows drew beyond their candidates
    assert torch.equal(draft_data.choose_next(logits, 0.0, top_p, torch.Generator(), candidates=8), logits.argmax(-1))


def test_continuing_in_batches_gives_what_one_batch_gives():
    model = build_llama(vocab_size=96, seed=11).eval()
    prompts = _prompts(96)
    whole = draft_data.continue_batch(model, prompts, 10, 0.0, 1.0, 3, {0}, 0, seed=5)
    parts = draft_data.continue_in_batches(model, prompts, 3, 10, 0.0, 1.0, 3, {0}, 0, seed=5)  # batches of 3 and 1
    for a, b in zip(whole, parts, strict=True):
        assert a["prompt_ids"] == b["prompt_ids"] and a["generated_ids"] == b["generated_ids"]
        assert torch.equal(a["top_ids"], b["top_ids"])
        torch.testing.assert_close(a["top_logprobs"].float(), b["top_logprobs"].float(), rtol=0, atol=2e-3)
    # One batch (0) samples with the seed itself, as continue_batch does.
    sampled = draft_data.continue_batch(model, prompts, 10, 1.0, 0.9, 3, {0}, 0, seed=5)
    one = draft_data.continue_in_batches(model, prompts, 0, 10, 1.0, 0.9, 3, {0}, 0, seed=5)
    assert [r["generated_ids"] for r in one] == [r["generated_ids"] for r in sampled]


def test_definition_sources_are_what_ast_cuts_out():
    """source_segment, split once per file, cuts what ast.get_source_segment cuts, across the
    line endings ast counts (CRLF, a lone CR) and those it does not (a form feed), multi-byte
    characters before a column offset, and one-line and nested definitions."""
    import ast

    source = (
        "import os\r\n"
        "def crlf(a, b):\r\n"
        '    """Add, über CRLF."""\r\n'
        "    return a + b\r\n"
        "\x0c\n"
        "class Lone:\r"
        '    """A lone CR ends lines here."""\r'
        "    def method(self): return 'é'\r"
        "\n"
        "x = {'ü': 1}; y = lambda: 0\n"
        "def one_line(): 'doc'; return 1\n"
        "def outer():\n"
        '    """Outer \x0c with a form feed inside."""\n'
        "    def inner(): return 'ß'\n"
        "    return inner\n"
        "def tail(): pass"
    )
    tree = ast.parse(source)
    lines = draft_data._LINE.findall(source)
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert len(nodes) == 7
    for node in nodes:
        assert draft_data.source_segment(lines, node) == ast.get_source_segment(source, node), node.name
    names = [d["name"] for d in draft_data.documented_definitions("m", source)]
    assert sorted(names) == ["Lone", "crlf", "one_line", "outer"]
