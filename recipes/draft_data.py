"""The draft recipe's data: prompts written from the Python standard library, and the target's
own continuations of them with its top-k log-probabilities at every position.

Everything here is rebuilt offline from the stdlib this interpreter ships. Files are split by
the sha1 of their relative path, so a held-out file never lends a prompt to training.

Prompts come in three kinds, as the server is used:
- code: a window of a stdlib file, cut at a line start, continued as plain text;
- chat: one user message (sometimes after a system message) that the recipe writes from a
  function or class of the stdlib: write it from its docstring, explain its source, document
  it, test it; rendered with the target's chat template;
- self: one user message that the target itself writes when given the template's start of a
  user turn (the requests it was tuned to answer: code, prose, questions), rendered the same way.

A shard is a batch of prompts continued together by the target, greedily or sampled as the
shard's seed decides. It stores, per sequence, the prompt ids, the generated ids and the
target's top-k log-probabilities (temperature 1, before any sampling settings) at every
position after the first: the prompt's (teacher-forced) and the continuation's.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import sysconfig
from pathlib import Path

import torch

EXCLUDED_DIRS = {"test", "tests", "idle_test", "lib2to3", "site-packages", "__pycache__", "idlelib", "turtledemo"}

SYSTEM_MESSAGES = (
    "You are a concise Python expert.",
    "You are a helpful coding assistant. Answer with code where it helps.",
    "You are a patient teacher who explains programming clearly.",
)


def stdlib_root(explicit: Path | None = None) -> Path:
    """`explicit` if given (another interpreter's stdlib, to rebuild that data), else this interpreter's."""
    return explicit if explicit is not None else Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[str]:
    """Relative paths (posix, sorted) of the stdlib's *.py files, tests and demos left out."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                found.append((Path(dirpath) / name).relative_to(root).as_posix())
    return sorted(found)


def is_heldout(relative_path: str, percent: int) -> bool:
    digest = int.from_bytes(hashlib.sha1(relative_path.encode()).digest()[:8], "big")
    return digest % 100 < percent


def read_split(heldout_percent: int, heldout: bool, root: Path | None = None) -> dict[str, str]:
    """{relative path: source} for one side of the split of the stdlib at `root` (default: this interpreter's)."""
    root = stdlib_root(root)
    sources = {}
    for rel in stdlib_files(root):
        if is_heldout(rel, heldout_percent) != heldout:
            continue
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            sources[rel] = text
    return sources


def code_prompt(source: str, rng: random.Random, min_lines: int = 6, max_chars: int = 900) -> str:
    """A window of whole lines ending mid-file, at most `max_chars` long."""
    lines = source.splitlines(keepends=True)
    if len(lines) <= min_lines + 1:
        return source[:max_chars]
    end = rng.randrange(min_lines, len(lines))
    window: list[str] = []
    size = 0
    for line in reversed(lines[:end]):
        if size + len(line) > max_chars and len(window) >= min_lines:
            break
        window.insert(0, line)
        size += len(line)
    return "".join(window)[-max_chars:]


# A line and its ending as ast counts lines: "\r\n", "\r" or "\n" end one (str.splitlines would
# also split at form feeds and other separators, and miscount ast's line numbers).
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def source_segment(lines: list[str], node: ast.AST) -> str:
    """ast.get_source_segment(source, node) for `lines` = _LINE.findall(source), split once per
    file: get_source_segment splits the whole source again for every node, which made reading
    the stdlib's definitions take 40 s."""
    first, last = node.lineno - 1, node.end_lineno - 1
    # Column offsets count UTF-8 bytes.
    if first == last:
        return lines[first].encode()[node.col_offset : node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset :].decode()
    tail = lines[last].encode()[: node.end_col_offset].decode()
    return "".join([head, *lines[first + 1 : last], tail])


def documented_definitions(module: str, source: str) -> list[dict]:
    """Top-level and method definitions that have a docstring: name, signature, doc, source."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = _LINE.findall(source)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.name.startswith("_"):
            continue
        segment = source_segment(lines, node)
        if isinstance(node, ast.ClassDef):
            signature = node.name
        else:
            signature = f"{node.name}({ast.unparse(node.args)})"
        found.append(
            {
                "module": module,
                "name": node.name,
                "kind": "class" if isinstance(node, ast.ClassDef) else "function",
                "signature": signature,
                "summary": doc.strip().split("\n\n")[0].replace("\n", " ")[:300],
                "source": "\n".join(segment.splitlines()[:40]),
            }
        )
    return found


def chat_messages(definition: dict, rng: random.Random) -> list[dict]:
    """One user request about `definition`, in one of several shapes a user would write."""
    d = definition
    summary = d["summary"].rstrip(".")
    requests = [
        f"Write a Python {d['kind']} `{d['signature']}`: {summary}.",
        f"Explain what this Python code does:\n\n```python\n{d['source']}\n```",
        f"What does `{d['module']}.{d['name']}` in the Python standard library do? Give an example.",
        f"Write a docstring and type hints for this code:\n\n```python\n{d['source']}\n```",
        f"Write pytest tests for `{d['module']}.{d['name']}`, which does this: {summary}.",
        f"How can I do this in Python: {summary[:1].lower() + summary[1:]}?",
        f"Rewrite this code to be shorter and clearer:\n\n```python\n{d['source']}\n```",
        f"Find possible bugs in this code:\n\n```python\n{d['source']}\n```",
    ]
    messages = []
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_MESSAGES)})
    messages.append({"role": "user", "content": rng.choice(requests)})
    return messages


def module_name(relative_path: str) -> str:
    return relative_path[: -len(".py")].replace("/", ".").removesuffix(".__init__")


def all_definitions(sources: dict[str, str]) -> list[dict]:
    return [d for rel in sorted(sources) for d in documented_definitions(module_name(rel), sources[rel])]


def make_prompts(tokenizer, sources: dict[str, str], definitions: list[dict], count: int, seed: int, chat_fraction: float, max_prompt_tokens: int, self_fraction: float = 0.0) -> list[dict]:
    """`count` prompts ({"kind", "text"}, text already rendered for chat) from `sources`.

    A "self" prompt's text is None: the target writes its user message (write_self_chats).
    """
    rng = random.Random(seed)
    paths = sorted(sources)
    prompts = []
    while len(prompts) < count:
        draw = rng.random()
        if draw < chat_fraction:
            messages = chat_messages(rng.choice(definitions), rng)
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            kind = "chat"
        elif draw < chat_fraction + self_fraction:
            prompts.append({"kind": "self", "text": None})
            continue
        else:
            text = code_prompt(sources[rng.choice(paths)], rng)
            kind = "code"
        if 0 < len(tokenizer(text)["input_ids"]) <= max_prompt_tokens:
            prompts.append({"kind": kind, "text": text})
    return prompts


def prompts_file_ids(path: Path, tokenizer) -> list[tuple[str, list[int]]]:
    """(kind, token ids) of each prompt of a JSON list written by hand (the evaluation's, never
    data): a string is a completion prompt (kind code); a list of messages ({"role", "content"})
    is a chat, rendered with the tokenizer's chat template (kind chat)."""
    prompts = []
    for entry in json.loads(path.read_text()):
        if isinstance(entry, str):
            kind, text = "code", entry
        else:
            kind, text = "chat", tokenizer.apply_chat_template(entry, add_generation_prompt=True, tokenize=False)
        prompts.append((kind, tokenizer(text)["input_ids"]))
    return prompts


def user_turn_prefix(tokenizer) -> str:
    """The chat template's text before a first user message's content (its default system message included)."""
    marker = "\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return text[: text.index(marker)]


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


def choose_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator, candidates: int | None = None) -> torch.Tensor:
    """Greedy at temperature 0, else temperature + top-p sampling. logits [B, V] -> [B].

    With `candidates`, each row's nucleus is looked for among its `candidates` likeliest tokens
    first: on a CPU a top-k of 1024 costs a tenth of sorting 49152 ids (20 against 165 ms for
    48 rows, one thread; timeit, 2026-11-27). A row whose candidates do not hold more than
    top_p of the mass is sorted whole, so every row keeps the tokens a whole sort keeps.
    """
    if temperature == 0.0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)  # [B, V]
    if top_p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if candidates is None or candidates >= probs.shape[-1]:
        return _draw_from_nucleus(*probs.sort(dim=-1, descending=True), top_p, generator)
    top_probs, top_ids = probs.topk(candidates, dim=-1)  # [B, M] each, descending
    whole = top_probs.cumsum(-1)[:, -1] <= top_p  # [B]: the nucleus may reach past the candidates
    token = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)  # [B]
    if not bool(whole.all()):
        token[~whole] = _draw_from_nucleus(top_probs[~whole], top_ids[~whole], top_p, generator)
    if bool(whole.any()):
        token[whole] = _draw_from_nucleus(*probs[whole].sort(dim=-1, descending=True), top_p, generator)
    return token


def nucleus(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p weights of probabilities sorted descending [B, M]: each row keeps its likeliest
    tokens up to the first whose mass before it exceeds top_p; the rest become 0. [B, M]"""
    outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # [B, M]: mass before it already > top_p
    return sorted_probs.masked_fill(outside, 0.0)


def _draw_from_nucleus(sorted_probs: torch.Tensor, sorted_ids: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row from the nucleus of sorted_probs [B, M], whose ids are sorted_ids [B, M]. -> [B]"""
    picked = torch.multinomial(nucleus(sorted_probs, top_p), 1, generator=generator)  # [B, 1]
    return sorted_ids.gather(-1, picked).squeeze(-1)


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
