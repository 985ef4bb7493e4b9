"""A tokenizer as a model worker serves it, in plain data: what the coordinator tokenises with.

The coordinator tokenises prompts, renders chat templates and detokenises without the model's
libraries (no torch, no transformers): the target worker exports its tokenizer once (the
`tokenizers` library's own serialisation, the chat template and what the template sees), with
probes of its own results that the coordinator reproduces before it serves.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class TokenizerProbe:
    """One text (encoded with the tokenizer's special tokens) or one chat (rendered with a
    generation prompt, encoded without them), and the ids the worker's tokenizer gave."""

    token_ids: tuple[int, ...]
    text: str = ""
    chat: tuple[tuple[str, str], ...] = ()  # (role, content) of each message
    decoded: str = ""  # token_ids decoded by the worker, special tokens skipped


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    tokenizer_json: str  # tokenizers.Tokenizer.to_str(): model, normalisers, special-token post-processing
    chat_template: str = ""  # Jinja; "" when the tokenizer has none
    template_variables: Mapping[str, object] = dataclasses.field(default_factory=dict)  # bos_token, eos_token, ...
    clean_up_tokenization_spaces: bool = False  # decoding drops the space before punctuation
    probes: tuple[TokenizerProbe, ...] = ()
    split_special_tokens: bool = False  # special-token strings in a text are split like any text


def fingerprint(vocab: Mapping[str, int]) -> str:
    """A digest of the string -> id mapping: equal digests mean the same ids for the same strings."""
    ordered = sorted(vocab.items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(ordered, ensure_ascii=False).encode()).hexdigest()
