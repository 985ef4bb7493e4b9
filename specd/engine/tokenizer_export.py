"""A loaded Hugging Face tokenizer exported as a TokenizerSpec (specd/core/tokenizer_spec.py).

The export is the tokenizer as transformers has set it up (its `tokenizers` backend after
transformers' own adjustments: the special tokens it adds, the post-processor), so the
coordinator's encoding is this one's, not the files' on disk. The probes are this tokenizer's
own results on a few texts and chats (their ids, and those ids decoded), which the coordinator
checks it reproduces.
"""

from __future__ import annotations

import json
import logging

from specd.core.tokenizer_spec import TokenizerProbe, TokenizerSpec

log = logging.getLogger(__name__)

# Texts that exercise what tokenizers disagree on: leading and repeated spaces, punctuation, code,
# digits, non-ASCII text, an emoji (byte fallback), newlines and tabs.
PROBE_TEXTS = (
    "Hello, world!",
    "  def f(x):\n\treturn x ** 2  # square\n",
    "Numbers 12345 and 3.14159; ünïcödé, 日本語, and 🙂.",
    "It's a test - isn't it? Yes , it is .",
)
PROBE_CHATS = (
    (("user", "Write a Python function that reverses a string."),),
    (("system", "You are terse."), ("user", "Hi!"), ("assistant", "Hello."), ("user", "What is 2 + 2?")),
)


def export_tokenizer_or_none(tokenizer) -> TokenizerSpec | None:
    """export_tokenizer, or None (said in the log) for a tokenizer it cannot export: the
    coordinator then needs --tokenizer."""
    try:
        return export_tokenizer(tokenizer)
    except Exception as exc:  # noqa: BLE001 - the worker serves on; only the export is missing
        log.warning("the tokenizer cannot be exported to the coordinator (%s): start it with --tokenizer", exc)
        return None


def export_tokenizer(tokenizer) -> TokenizerSpec:
    """The spec of a transformers fast tokenizer (one with a `tokenizers` backend)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} has no `tokenizers` backend: specd serves fast tokenizers only")
    template = _chat_template(tokenizer)
    return TokenizerSpec(
        tokenizer_json=backend.to_str(),
        chat_template=template,
        template_variables=json.loads(json.dumps(dict(tokenizer.special_tokens_map), default=str)),
        clean_up_tokenization_spaces=_cleans_up(tokenizer),
        probes=_probes(tokenizer, template),
        split_special_tokens=bool(getattr(tokenizer, "split_special_tokens", False)),
    )


def _chat_template(tokenizer) -> str:
    """The template apply_chat_template uses with no name given (of several named ones, the default)."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    try:
        template = tokenizer.get_chat_template()
    except ValueError:  # named templates and none called default
        return ""
    return template if isinstance(template, str) else ""


def _cleans_up(tokenizer) -> bool:
    """Whether decode() drops spaces before punctuation: transformers skips it for BPE models."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return type(tokenizer.backend_tokenizer.model).__name__ != "BPE" or bool(forced)


def _probes(tokenizer, template: str) -> tuple[TokenizerProbe, ...]:
    specials = [token for token in tokenizer.all_special_tokens if token][:2]
    texts = [*PROBE_TEXTS, "".join(specials) + " text between " + "".join(reversed(specials))] if specials else list(PROBE_TEXTS)
    probes = [_probe(tokenizer, tuple(tokenizer.encode(text, add_special_tokens=True)), text=text) for text in texts]
    if template:
        for chat in PROBE_CHATS:
            messages = [{"role": role, "content": content} for role, content in chat]
            try:
                rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as exc:  # noqa: BLE001 - a template may refuse a system message, say
                log.info("the chat template does not render probe %r (%s): not probed", chat, exc)
                continue
            probes.append(_probe(tokenizer, tuple(tokenizer.encode(rendered, add_special_tokens=False)), chat=chat))
    return tuple(probes)


def _probe(tokenizer, ids: tuple[int, ...], **what) -> TokenizerProbe:
    return TokenizerProbe(ids, decoded=tokenizer.decode(list(ids), skip_special_tokens=True), **what)
