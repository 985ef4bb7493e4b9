"""The draft recipe's data: prompts written from the Python standard library, and the target's
own continuations of them with its top-k log-probabilities at every position.

This module continues prompts with the target. The stdlib and its held-out split are in
draft_stdlib.py, the kinds of prompt in draft_prompts.py, and how the next token is chosen in
draft_sampling.py; their names are imported here too, so that the recipe, its tests and the
benchmarks find all of the data's names in one module.

A shard is a batch of prompts continued together by the target, greedily or sampled as the
shard's seed decides. It stores, per sequence, the prompt ids, the generated ids and the
target's top-k log-probabilities (temperature 1, before any sampling settings) at every
position after the first: the prompt's (teacher-forced) and the continuation's.
"""

from __future__ import annotations

import random

import torch

from draft_prompts import SYSTEM_MESSAGES, chat_messages, code_prompt, make_prompts, prompts_file_ids, user_turn_prefix  # noqa: F401
from draft_sampling import choose_next, nucleus  # noqa: F401
from draft_stdlib import (  # noqa: F401
    _LINE,
    EXCLUDED_DIRS,
    all_definitions,
    documented_definitions,
    is_heldout,
    module_name,
    read_split,
    source_segment,
    stdlib_files,
    stdlib_root,
)


def write_self_chats(model, tokenizer, prompts: list[dict], definitions: list[dict], seed: int, max_message_tokens: int = 96, rows_per_batch: int = 0) -> None:
    """Fill in the "self" prompts: the target, given the template's start of a user turn, writes
    the user's message itself (sampled at temperature 1, top-p 0.95), which is then rendered as
    a chat prompt. These are requests of the kinds the instruct model was tuned on, far wider
    than the stdlib's. A message that does not end within `max_message_tokens`, or is too short
    to be a request, gives way to a stdlib chat prompt."""
    wanted = [p for p in prompts if p["kind"] == "self"]
    if not wanted:
        return
    end_of_turn = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    prefix = tokenizer(user_turn_prefix(tokenizer))["input_ids"]
    rows = continue_in_batches(model, [prefix] * len(wanted), rows_per_batch, max_message_tokens, 1.0, 0.95, 1, {end_of_turn}, tokenizer.pad_token_id, seed)
    rng = random.Random(seed)
    for prompt, row in zip(wanted, rows):
        ids = row["generated_ids"]
        message = tokenizer.decode(ids[:-1]).strip() if ids and ids[-1] == end_of_turn else ""
        if len(ids) > 4 and message:
            messages = [{"role": "user", "content": message}]
        else:
            messages = chat_messages(rng.choice(definitions), rng)
            prompt["kind"] = "chat"
        prompt["text"] = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def continue_in_batches(model, prompt_ids: list[list[int]], rows_per_batch: int, new_tokens: int, temperature: float, top_p: float, topk: int, eos_ids: set[int], pad_id: int, seed: int) -> list[dict]:
    """continue_batch over consecutive batches of at most `rows_per_batch` prompts (0: one batch),
    so that a shard's KV cache fits in the device's memory: the default target's takes some 20 MB
    a row at 448 tokens, 20 GB for a shard of 1,024. The batch from prompt i on samples from
    seed + i, so one batch samples as continue_batch does."""
    size = rows_per_batch or len(prompt_ids)
    rows = []
    for first in range(0, len(prompt_ids), size):
        rows += continue_batch(model, prompt_ids[first : first + size], new_tokens, temperature, top_p, topk, eos_ids, pad_id, seed + first)
    return rows


@torch.inference_mode()
def continue_batch(model, prompt_ids: list[list[int]], new_tokens: int, temperature: float, top_p: float, topk: int, eos_ids: set[int], pad_id: int, seed: int) -> list[dict]:
    """Continue every prompt (left-padded into one batch); keep the target's top-k log-probs.

    On the CPU each prompt is prefilled alone (padding would cost compute); on an accelerator
    the whole batch is prefilled in one forward (see _prefill_padded). A row that has ended
    leaves the batch (on an accelerator at the next 8th step). The rows come back on the CPU.
    """
    device = model.device
    generator = torch.Generator(device=device).manual_seed(seed)
    batch, width = len(prompt_ids), max(len(p) for p in prompt_ids)
    prefill = _prefill_rows if device.type == "cpu" else _prefill_padded
    cache, prompt_top, last_hidden = prefill(model, prompt_ids, width, topk)
    mask = torch.zeros((batch, width), dtype=torch.long, device=device)  # [B, L]
    for row, ids in enumerate(prompt_ids):
        mask[row, width - len(ids):] = 1
    last_position = torch.tensor([len(ids) - 1 for ids in prompt_ids], device=device)  # [B]
    logits = model.lm_head(last_hidden)  # [B, V]
    tokens = torch.full((batch, new_tokens), pad_id if pad_id is not None else 0, dtype=torch.long, device=device)  # [B, T]
    top_values = torch.zeros((batch, new_tokens, topk), dtype=torch.float16, device=device)  # [B, T, k]
    top_indices = torch.zeros((batch, new_tokens, topk), dtype=torch.int32, device=device)  # [B, T, k]
    eos = torch.tensor(sorted(eos_ids), device=device)  # [E]
    # On an accelerator a whole sort is cheap, and asking which rows' nuclei fit would wait for it.
    candidates = 1024 if device.type == "cpu" else None
    live = torch.arange(batch, device=device)  # [b]: the rows still being continued
    done = torch.zeros(batch, dtype=torch.bool, device=device)  # [b]: live rows that have ended
    steps = 0
    for step in range(new_tokens):
        values, indices = _topk_logprobs(logits, topk)  # [b, k] each
        token = choose_next(logits.float(), temperature, top_p, generator, candidates)  # [b]
        tokens[live, step], top_values[live, step], top_indices[live, step] = token, values.half(), indices.int()
        done |= torch.isin(token, eos)
        steps = step + 1
        # Asking which rows are done waits for the device: on an accelerator, ask every 8th step.
        if device.type == "cpu" or step % 8 == 7:
            going = (~done).nonzero().squeeze(-1)  # [b']
            if going.numel() == 0:
                break
            if going.numel() < live.numel():
                # Ended rows leave the batch, so the steps left cost what the rows still going cost.
                live, token, mask, last_position, done = live[going], token[going], mask[going], last_position[going], done[going]
                cache.batch_select_indices(going)
        mask = torch.cat([mask, torch.ones((live.numel(), 1), dtype=torch.long, device=device)], dim=-1)  # [b, L+t]
        last_position = last_position + 1
        out = model(input_ids=token.unsqueeze(-1), attention_mask=mask, position_ids=last_position.unsqueeze(-1), past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1]  # [b, V]
    # A row's continuation ends at its first end-of-sequence token, which it keeps.
    is_eos = torch.isin(tokens[:, :steps], eos)  # [B, steps]
    lengths = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, steps).tolist()  # [B]
    tokens, top_values, top_indices = tokens.cpu(), top_values.cpu(), top_indices.cpu()
    rows = []
    for row, ids in enumerate(prompt_ids):
        n = lengths[row]
        # Position i's distribution predicts token i+1: the prompt's rows 0..n-2 are teacher-forced,
        # row n-1 predicts the first generated token, which the generation rows cover.
        values = torch.cat([prompt_top[row][0][:-1].half().cpu(), top_values[row, :n]])  # [n-1+g, k]
        indices = torch.cat([prompt_top[row][1][:-1].int().cpu(), top_indices[row, :n]])
        rows.append({"prompt_ids": ids, "generated_ids": tokens[row, :n].tolist(), "top_logprobs": values, "top_ids": indices})
    return rows


def _prefill_padded(model, prompt_ids: list[list[int]], width: int, topk: int, rows_per_chunk: int = 16):
    """Prefill the whole batch in one forward, for an accelerator. Same returns as _prefill_rows.

    The prompts are right-padded for the forward (a left pad's queries would attend to nothing,
    which some attention kernels answer with NaN), then each row's keys and values are rolled to
    the left-padded layout the decode steps use; rotary positions come from position_ids, so a
    roll moves them unchanged, and the pad slots are zeroed (the mask hides them).
    """
    from transformers import DynamicCache

    from specd.engine.kv_cache import GrowingKVCache

    device = model.device
    batch = len(prompt_ids)
    lengths = torch.tensor([len(ids) for ids in prompt_ids], device=device)  # [B]
    input_ids = torch.zeros((batch, width), dtype=torch.long, device=device)  # [B, L]
    for row, ids in enumerate(prompt_ids):
        input_ids[row, : len(ids)] = torch.tensor(ids, device=device)
    right_mask = (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()  # [B, L]
    positions = torch.arange(width, device=device).expand(batch, width)  # [B, L]
    filled = DynamicCache()
    hidden = model.model(input_ids=input_ids, attention_mask=right_mask, position_ids=positions, past_key_values=filled, use_cache=True).last_hidden_state  # [B, L, H]
    prompt_top = []
    for first in range(0, batch, rows_per_chunk):
        values, indices = _topk_logprobs(model.lm_head(hidden[first : first + rows_per_chunk]), topk)  # [c, L, k] each
        for offset in range(values.shape[0]):
            n = len(prompt_ids[first + offset])
            prompt_top.append((values[offset, :n], indices[offset, :n]))
    last = hidden[torch.arange(batch, device=device), lengths - 1]  # [B, H]
    pad = width - lengths  # [B]
    source = (torch.arange(width, device=device)[None, :] - pad[:, None]) % width  # [B, L]: left slot <- right slot
    left_valid = torch.arange(width, device=device)[None, :] >= pad[:, None]  # [B, L]
    cache = GrowingKVCache()  # the decode steps write into it in place
    for index, layer in enumerate(filled.layers):
        gather = source[:, None, :, None].expand_as(layer.keys)  # [B, heads, L, D]
        keep = left_valid[:, None, :, None]  # [B, 1, L, 1]
        keys = layer.keys.gather(2, gather) * keep
        values = layer.values.gather(2, gather) * keep
        cache.update(keys, values, index)
        # Freed layer by layer, so the prefill's cache and the growing one are never both whole.
        layer.keys = layer.values = None
    return cache, prompt_top, last


def _prefill_rows(model, prompt_ids: list[list[int]], width: int, topk: int):
    """Prefill each prompt alone (no padding to compute), then lay the caches side by side,
    left-padded with zeros that the attention mask hides. Returns (batched cache, per-row
    top-k log-probs of the prompt positions, last hidden states [B, H])."""
    from transformers import DynamicCache

    from specd.engine.kv_cache import GrowingKVCache

    per_layer: list[tuple[list, list]] = []
    prompt_top, last = [], []
    for ids in prompt_ids:
        row_cache = DynamicCache()
        hidden = model.model(input_ids=torch.tensor([ids]), past_key_values=row_cache, use_cache=True).last_hidden_state[0]  # [n, H]
        prompt_top.append(_topk_logprobs(model.lm_head(hidden), topk))  # ([n, k], [n, k])
        last.append(hidden[-1])
        for index, layer in enumerate(row_cache.layers):
            pad = width - len(ids)
            keys = torch.nn.functional.pad(layer.keys, (0, 0, pad, 0))  # [1, heads, L, D]
            values = torch.nn.functional.pad(layer.values, (0, 0, pad, 0))
            if index == len(per_layer):
                per_layer.append(([], []))
            per_layer[index][0].append(keys)
            per_layer[index][1].append(values)
    cache = GrowingKVCache()  # the decode steps write into it in place
    for index, (keys, values) in enumerate(per_layer):
        cache.update(torch.cat(keys), torch.cat(values), index)  # [B, heads, L, D]
    return cache, prompt_top, torch.stack(last)


def _topk_logprobs(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (log-probs [..., k], ids [..., k]) of the k likeliest tokens."""
    return torch.log_softmax(logits.float(), dim=-1).topk(topk, dim=-1)
