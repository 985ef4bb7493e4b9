"""Newcomer mistakes get one clear line, no traceback: nothing serving at the address, and a
model path (target, draft, coordinator --tokenizer) that does not exist."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import running_stack


def specd(*args: str, env: dict | None = None, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specd", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.parametrize("json_flag", [["--json"], []], ids=["json", "stream"])
def test_generate_against_nothing_hints_at_specd_up(json_flag):
    address = f"127.0.0.1:{_closed_port()}"
    result = specd("generate", "--address", address, *json_flag, "hi", timeout=60)
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert address in lines[0] and "`specd up`" in lines[0], lines[0]


def test_generate_without_address_names_the_default_it_tried(tmp_path):
    """No --address, no SPECD_ADDRESS, no `specd up` running: the default address is named."""
    env = {"XDG_RUNTIME_DIR": str(tmp_path), "SPECD_ADDRESS": ""}
    result = specd("generate", "hi", env=env, timeout=60)
    if result.returncode == 0:
        pytest.skip("a coordinator serves on localhost:50051 here")
    assert "localhost:50051" in result.stderr and "`specd up`" in result.stderr, result.stderr


def test_a_coordinator_that_answers_unavailable_keeps_its_details(tiny_pair):
    with running_stack(tiny_pair[0], None) as stack:
        stack.stop_target()
        result = specd("generate", "--address", stack.address, "--json", "hi", timeout=60)
    assert result.returncode == 1
    assert result.stderr.startswith("UNAVAILABLE: target worker at"), result.stderr
    assert "specd up" not in result.stderr


@pytest.mark.parametrize("role,flag", [("target", "--model"), ("draft", "--model")])
def test_a_missing_model_folder_says_no_such_folder(tmp_path, role, flag):
    missing = str(tmp_path / "no-model-here")
    result = specd("serve", role, flag, missing, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1")
    assert result.returncode == 1
    assert f"specd serve {role}: no such folder: {missing}" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_missing_tokenizer_folder_says_no_such_folder(tiny_pair, tmp_path):
    missing = str(tmp_path / "no-tokenizer-here")
    with running_stack(tiny_pair[0], None) as stack:
        result = specd("serve", "coordinator", "--tokenizer", missing, "--host", "127.0.0.1", "--port", "0",
                       "--metrics-port", "-1", "--http-port", "-1", "--target-address", f"127.0.0.1:{stack.target.port}", "--draft-address", "")
    assert result.returncode == 1
    assert f"specd serve coordinator: no such folder: {missing}" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("which", ["--target", "--draft"])
def test_up_checks_model_folders_before_starting_anything(tiny_pair, tmp_path, which):
    missing = str(tmp_path / "nowhere")
    models = {"--target": tiny_pair[0], "--draft": tiny_pair[1], which: missing}
    result = specd("up", "--port", "0", "--metrics-port", "-1", "--http-port", "-1", "--log-dir", str(tmp_path / "logs"),
                   *[part for flag, value in models.items() for part in (flag, value)],
                   env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert result.returncode == 1
    assert result.stderr.strip() == f"specd up: no such folder: {missing} (a model is a local folder or a hub id like org/name)"
    assert not (tmp_path / "logs").exists()


def _unreachable_hub(tmp_path) -> dict:
    """A hub endpoint nothing listens on, and an empty hub cache."""
    return {"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": ""}


def test_an_empty_model_folder_says_it_holds_no_model(tmp_path):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    result = specd("serve", "target", "--model", str(empty), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1")
    assert result.returncode == 1
    assert f"specd serve target: {empty} holds no model: no config.json" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    result = specd("up", "--target", str(empty), "--draft", "", "--port", "0", "--metrics-port", "-1",
                   "--log-dir", str(tmp_path / "logs"), env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert result.returncode == 1
    assert result.stderr.strip().startswith(f"specd up: {empty} holds no model: no config.json"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "logs").exists()


def test_a_hub_id_with_the_hub_unreachable_fails_at_once(tmp_path):
    env = _unreachable_hub(tmp_path)
    result = specd("serve", "target", "--model", "someorg/some-model", "--host", "127.0.0.1", "--port", "0",
                   "--metrics-port", "-1", env=env)
    assert result.returncode == 1
    assert "specd serve target: someorg/some-model: the hub at http://127.0.0.1:" in result.stderr, result.stderr[-2000:]
    assert "pass a local model folder" in result.stderr and "Traceback" not in result.stderr
    result = specd("up", "--target", "someorg/some-model", "--draft", "", "--port", "0", "--metrics-port", "-1",
                   "--log-dir", str(tmp_path / "logs"), env={**env, "XDG_RUNTIME_DIR": str(tmp_path)})
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specd up: someorg/some-model: the hub at"), result.stderr


def test_an_empty_chat_is_refused_as_an_empty_prompt_is(tiny_pair):
    with running_stack(tiny_pair[0], None) as stack:
        prompt = specd("generate", "--address", stack.address, "", timeout=60)
        chat = specd("generate", "--address", stack.address, "--chat", "", timeout=60)
    assert prompt.returncode == chat.returncode == 1
    assert prompt.stderr.strip() == "INVALID_ARGUMENT: prompt is empty", prompt.stderr
    assert chat.stderr.strip().startswith("INVALID_ARGUMENT: messages: every message's content is empty"), chat.stderr
    assert chat.stdout == ""
