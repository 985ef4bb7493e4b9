"""The coordinator's tokenizer: the target worker's, rebuilt from its TokenizerSpec without the
model's libraries (`tokenizers` and Jinja, no torch, no transformers).

Before the coordinator serves, every probe the worker sent (its own ids for a few texts and
chats) must come out the same here: a tokenizer this module cannot reproduce stops the start
with a message, instead of serving prompts tokenised differently from the target's own.
"""

from __future__ import annotations

import json
import pathlib

from tokenizers import Tokenizer as FastTokenizer

from coordinator.chat_template import render_chat
from specd.core.tokenizer_spec import TokenizerProbe, TokenizerSpec, fingerprint

# transformers' clean-up of decoded text (for WordPiece-style tokenizers that ask for it).
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class Tokenizer:
    """encode, decode and apply_chat_template, as the worker's tokenizer does them."""

    def __init__(self, spec: TokenizerSpec):
        self.spec = spec
        self._backend = FastTokenizer.from_str(spec.tokenizer_json)
        self._backend.no_padding()
        self._backend.no_truncation()
        self._backend.encode_special_tokens = spec.split_special_tokens
        self.chat_template = spec.chat_template or None

    @classmethod
    def from_files(cls, name: str) -> "Tokenizer":
        """A tokenizer as transformers saves it (tokenizer.json, tokenizer_config.json,
        chat_template.jinja), from a local folder or a hub id, as its files say (--tokenizer)."""
        path = _tokenizer_folder(name)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {name}: --tokenizer takes a folder holding a fast tokenizer")
        config = json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").is_file() else {}
        template = config.get("chat_template") or ""
        if isinstance(template, list):  # named templates: the one apply_chat_template takes by default
            template = next((t.get("template", "") for t in template if t.get("name") == "default"), "")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        variables = {k: _token_text(v) for k, v in config.items() if k.endswith("_token") and _token_text(v)}
        return cls(TokenizerSpec((path / "tokenizer.json").read_text(), template if isinstance(template, str) else "", variables))

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def fingerprint(self) -> str:
        return fingerprint(self.get_vocab())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.spec.clean_up_tokenization_spaces:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The messages rendered with the chat template, with the prompt for the assistant's reply."""
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template")
        return render_chat(self.chat_template, messages, dict(self.spec.template_variables))

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The rendered chat's token ids (the template writes its special tokens itself)."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def probe_mismatches(self, probes: tuple[TokenizerProbe, ...] | None = None) -> list[str]:
        """The probes (the worker's, by default this spec's own) this tokenizer does not reproduce:
        their ids, and those ids decoded. None: it tokenises as the worker does."""
        wrong = []
        for probe in self.spec.probes if probes is None else probes:
            if probe.chat:
                what = f"the chat {[role for role, _ in probe.chat]}"
                try:
                    ids = self.chat_ids([{"role": r, "content": c} for r, c in probe.chat])
                except Exception as exc:  # noqa: BLE001 - reported below, as any other difference
                    wrong.append(f"{what}: the chat template failed here ({exc})")
                    continue
            else:
                what, ids = f"the text {probe.text!r}", self.encode(probe.text)
            if tuple(ids) != probe.token_ids:
                wrong.append(f"{what}: {list(probe.token_ids)[:12]} on the worker, {ids[:12]} here")
            elif probe.decoded and self.decode(list(probe.token_ids)) != probe.decoded:
                wrong.append(f"{what}: decodes to {probe.decoded!r} on the worker, {self.decode(list(probe.token_ids))!r} here")
        return wrong

def _token_text(value) -> str:
    """A special token as tokenizer_config.json stores it: a string, or an added token's {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content", "")
    return value if isinstance(value, str) else ""


_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _tokenizer_folder(name: str) -> pathlib.Path:
    """A local folder, or a hub id's tokenizer files fetched into the hub's cache."""
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or pathlib.Path(name).exists():
        path = pathlib.Path(name).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"no such folder: {name} (a model is a local folder or a hub id like org/name)")
        return path
    from huggingface_hub import snapshot_download

    return pathlib.Path(snapshot_download(name, allow_patterns=list(_FILES)))
