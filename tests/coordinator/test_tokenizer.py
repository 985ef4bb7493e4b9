"""The coordinator's tokenizer (no transformers) against transformers' own, and its start-up probes."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoTokenizer

from coordinator.config import CoordinatorConfig
from coordinator.server import TokenizerMismatch, coordinator_tokenizer
from coordinator.tokenizer import Tokenizer
from specd.core.tokenizer_spec import TokenizerProbe
from specd.engine.tokenizer_export import export_tokenizer, export_tokenizer_or_none
from specd.v1 import target_pb2
from specd.wire.convert import tokenizer_spec_to_proto
from tests.tiny_models import build_tokenizer

TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "  leading spaces, trailing spaces  ",
    "Ünïcödé — «quotes» and 漢字 and emoji 🙂🚀",
    "tabs\tand\r\nwindows newlines",
    "It's fine , isn't it ? Yes !",
    "<|endoftext|> inside text <|endoftext|>",
    "",
]
CHATS = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Ünïcödé 🙂?"}],
]
CHAT_TEMPLATE = (
    "{% if tools is not none %}[TOOLS]{% endif %}{% if documents is not none %}[DOCS]{% endif %}"
    "{% for m in messages %}{{ bos_token }}[{{ m['role'] | upper }}] {{ m['content'] | tojson }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)


def tokenizers_under_test(tmp_path):
    tiny = build_tokenizer()
    tiny.chat_template = CHAT_TEMPLATE
    tiny.save_pretrained(tmp_path / "tiny")
    yield "tiny", AutoTokenizer.from_pretrained(tmp_path / "tiny")
    from specd.engine import default_target

    try:
        folder = default_target.target_folder()
    except default_target.DefaultTargetMissing:
        return
    yield "smollm2", AutoTokenizer.from_pretrained(folder)


def test_it_encodes_renders_and_decodes_as_transformers_does(tmp_path):
    for name, reference in tokenizers_under_test(tmp_path):
        ours = Tokenizer(export_tokenizer(reference))
        assert ours.fingerprint() == export_fingerprint(reference), name
        assert len(ours) == len(reference), name
        for text in TEXTS:
            ids = reference.encode(text, add_special_tokens=True)
            assert ours.encode(text) == ids, (name, text)
            assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
            assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), (name, text)
        for chat in CHATS:
            rendered = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            assert ours.apply_chat_template(chat) == rendered, (name, chat)
        special = reference.all_special_tokens[0] + "x" + reference.all_special_tokens[0]
        assert ours.encode(special) == reference.encode(special, add_special_tokens=True), name
        assert ours.probe_mismatches() == [], name


def export_fingerprint(tokenizer) -> str:
    from specd.engine.loading import tokenizer_fingerprint

    return tokenizer_fingerprint(tokenizer)


def test_a_tokenizer_that_tokenises_otherwise_fails_its_probes():
    spec = export_tokenizer(build_tokenizer())
    text_probe = spec.probes[0]
    wrong = dataclasses.replace(text_probe, token_ids=text_probe.token_ids + (1,))
    mismatches = Tokenizer(dataclasses.replace(spec, probes=(wrong,))).probe_mismatches()
    assert len(mismatches) == 1 and repr(text_probe.text) in mismatches[0]


def test_a_template_that_fails_here_is_reported_not_raised():
    spec = dataclasses.replace(
        export_tokenizer(build_tokenizer()),
        chat_template="{{ raise_exception('no') }}",
        probes=(TokenizerProbe((1, 2), chat=(("user", "hi"),)),),
    )
    mismatches = Tokenizer(spec).probe_mismatches()
    assert len(mismatches) == 1 and "failed here" in mismatches[0]


def test_a_missing_tokenizer_folder_is_named():
    with pytest.raises(FileNotFoundError, match="no such folder: ./nowhere"):
        Tokenizer.from_files("./nowhere")


def _info(spec, fingerprint: str) -> target_pb2.TargetInfo:
    return target_pb2.TargetInfo(model="tiny", tokenizer_fingerprint=fingerprint, tokenizer=tokenizer_spec_to_proto(spec))


def test_a_tokenizer_given_on_the_command_line_is_checked_against_the_targets_probes(tmp_path):
    """--tokenizer reads files, which may lack what transformers sets up at load: the target's own
    probes decide whether it may serve."""
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tok")
    spec = export_tokenizer(AutoTokenizer.from_pretrained(tmp_path / "tok"))
    fingerprint = export_fingerprint(AutoTokenizer.from_pretrained(tmp_path / "tok"))
    config = CoordinatorConfig(tokenizer=str(tmp_path / "tok"))
    assert coordinator_tokenizer(config, _info(spec, fingerprint)).probe_mismatches(spec.probes) == []
    first = spec.probes[0]
    other = dataclasses.replace(spec, probes=(dataclasses.replace(first, token_ids=(0,) + first.token_ids),))
    with pytest.raises(TokenizerMismatch, match="does not tokenise as the target worker"):
        coordinator_tokenizer(config, _info(other, fingerprint))


def test_a_target_that_cannot_export_its_tokenizer_asks_for_one():
    assert export_tokenizer_or_none(object()) is None  # not a fast tokenizer: the worker serves on without it
    with pytest.raises(TokenizerMismatch, match="point --tokenizer"):
        coordinator_tokenizer(CoordinatorConfig(), target_pb2.TargetInfo(model="slow"))
