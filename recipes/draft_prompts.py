"""The draft recipe's prompts, in the kinds the server is used with:
- code: a window of a stdlib file, cut at a line start, continued as plain text;
- chat: one user message (sometimes after a system message) that the recipe writes from a
  function or class of the stdlib: write it from its docstring, explain its source, document
  it, test it; rendered with the target's chat template;
- self: one user message that the target itself writes when given the template's start of a
  user turn (the requests it was tuned to answer: code, prose, questions), rendered the same
  way (draft_data.write_self_chats fills these in).
Also the prompts of a JSON file written by hand, which only the evaluation reads.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SYSTEM_MESSAGES = (
    "You are a concise Python expert.",
    "You are a helpful coding assistant. Answer with code where it helps.",
    "You are a patient teacher who explains programming clearly.",
)


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
