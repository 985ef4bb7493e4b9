"""The specd command line: generate --json, error statuses, up, serve --help."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import copy_target, running_stack

GENERATE_KEYS = {"text", "token_ids", "finish_reason", "usage", "stats", "trace_id"}
STATS_KEYS = {"mode", "rounds", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length"}


def specd(*args: str, timeout: float = 120.0, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specd", *args], capture_output=True, text=True, timeout=timeout, input=stdin
    )


@pytest.fixture(scope="module")
def stack(tiny_pair):
    with running_stack(*tiny_pair) as running:
        yield running


def test_generate_json_prints_exactly_one_object(stack):
    result = specd(
        "generate", "--address", stack.address, "--json", "--max-new-tokens", "12",
        "--temperature", "0", "--mode", "sd", "--ignore-eos", "--", "def add(a, b):",
    )
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)  # fails on anything but one JSON document
    assert GENERATE_KEYS <= body.keys()
    assert STATS_KEYS <= body["stats"].keys()
    assert len(body["token_ids"]) == 12
    assert body["finish_reason"] == "length"
    assert body["stats"]["mode"] == "sd"
    assert body["usage"]["completion_tokens"] == 12
    rounds = body["stats"]["rounds"]
    assert body["stats"]["mean_acceptance_length"] == pytest.approx(1 + body["stats"]["accepted_tokens"] / rounds)


def test_generate_reads_the_prompt_from_stdin_given_a_dash(stack):
    prompt = "def add(a, b):\n" * 40  # as a file piped in
    args = ("generate", "--address", stack.address, "--json", "--max-new-tokens", "4", "--temperature", "0", "--mode", "off")
    from_stdin = json.loads(specd(*args, "-", stdin=prompt).stdout)
    from_argument = json.loads(specd(*args, "--", prompt).stdout)
    assert from_stdin["usage"]["prompt_tokens"] == from_argument["usage"]["prompt_tokens"] > 40
    assert from_stdin["token_ids"] == from_argument["token_ids"]


def test_generate_error_status_goes_to_stderr_with_exit_1(stack):
    result = specd("generate", "--address", stack.address, "--json", "--temperature", "-1", "x")
    assert result.returncode == 1
    assert result.stdout == ""
    assert re.match(r"^INVALID_ARGUMENT: .*temperature", result.stderr)


def test_generate_streams_text_without_json(stack):
    result = specd("generate", "--address", stack.address, "--max-new-tokens", "8", "--temperature", "0", "x = 1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n")
    assert "8 tokens" in result.stderr


# Shows each message's role and content, so the output's prompt tokens tell what was sent.
ROLE_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def chat_stack(tiny_pair, tmp_path_factory):
    target = copy_target(tiny_pair[0], tmp_path_factory.mktemp("chat_target"), chat_template=ROLE_TEMPLATE)
    with running_stack(target, tiny_pair[1]) as running:
        yield running


@pytest.mark.parametrize("system", [None, "be brief"])
def test_generate_chat_sends_one_user_message_and_an_optional_system_one(chat_stack, system):
    from transformers import AutoTokenizer

    extra = ["--system", system] if system else []
    result = specd("generate", "--address", chat_stack.address, "--json", "--max-new-tokens", "4",
                   "--temperature", "0", "--chat", *extra, "--", "hello there")
    assert result.returncode == 0, result.stderr
    rendered = (f"[system] {system}\n" if system else "") + "[user] hello there\n[assistant] "
    tokenizer = AutoTokenizer.from_pretrained(chat_stack.target_model)
    assert json.loads(result.stdout)["usage"]["prompt_tokens"] == len(tokenizer.encode(rendered))


@pytest.mark.parametrize(
    "flags, flag",
    [(["--seed", "-1"], "--seed"), (["-k", "-1"], "--num-speculative-tokens"), (["--top-k", "3000000000"], "--top-k"),
     (["--max-new-tokens", "99999999999"], "--max-new-tokens")],
)
def test_generate_values_the_wire_cannot_carry_are_one_line_naming_the_flag(flags, flag):
    result = specd("generate", "hello", *flags, "--address", "127.0.0.1:1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"specd generate: {flag}: ") and len(result.stderr.splitlines()) == 1


def test_generate_a_prompt_that_is_not_utf8_is_one_line():
    result = subprocess.run([sys.executable, "-m", "specd", "generate", "-", "--address", "127.0.0.1:1"],
                            input=b"def f(): return '\xff'\n", capture_output=True, timeout=120)
    assert result.returncode == 2 and result.stderr.decode() == "specd generate: PROMPT: is not UTF-8 text\n"


def test_a_bad_setting_in_the_environment_is_one_line_naming_it():
    result = subprocess.run([sys.executable, "-m", "specd", "serve", "coordinator", "--help"], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "SPECD_MAX_SESSIONS": "abc"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("specd: SPECD_MAX_SESSIONS='abc': ") and len(result.stderr.splitlines()) == 1


def test_generate_system_without_chat_is_refused():
    result = specd("generate", "--system", "be brief", "hello")
    assert result.returncode == 2
    assert "--system needs --chat" in result.stderr


@pytest.mark.parametrize("role", ["target", "draft", "coordinator"])
def test_serve_help_runs(role):
    result = specd("serve", role, "--help")
    assert result.returncode == 0, result.stderr
    assert "SPECD_PORT" in result.stdout


def test_up_prints_one_address_line_and_stops_everything(tiny_pair, tmp_path):
    target, draft = tiny_pair
    up = subprocess.Popen(
        # --device cpu: pinned as on a CPU host, on a GPU host too
        [sys.executable, "-m", "specd", "up", "--target", target, "--draft", draft, "--device", "cpu", "--port", "0",
         "--http-port", "0", "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = up.stdout.readline()
        match = re.fullmatch(r"coordinator listening on (\S+):(\d+)\n", line)
        assert match, f"unexpected first line {line!r}; stderr: {up.stderr.read() if up.poll() is not None else ''}"
        address = f"{match.group(1)}:{match.group(2)}"
        http_line = up.stdout.readline()  # right after the coordinator's: the OpenAI-compatible API
        assert (http := re.fullmatch(r"http listening on (127\.0\.0\.1:\d+)\n", http_line)), repr(http_line)
        with urllib.request.urlopen(f"http://{http.group(1)}/v1/models", timeout=30) as models:
            assert [model["id"] for model in json.load(models)["data"]] == [target]
        result = specd("generate", "--address", address, "--json", "--max-new-tokens", "4", "--temperature", "0", "hi")
        assert result.returncode == 0, result.stderr
        assert len(json.loads(result.stdout)["token_ids"]) >= 1
        children = _children(up.pid)
        assert len(children) == 3
        _assert_pinned_as_specd_up_lays_out(children)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    assert up.returncode == 0
    rest = up.stdout.read()
    assert "listening on" not in rest
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in children)


def _assert_pinned_as_specd_up_lays_out(children: list[int]) -> None:
    """With a CPU to spare, every thread of the target on the first CPU, the others' elsewhere."""
    available = sorted(os.sched_getaffinity(0))
    for pid in children:
        role = open(f"/proc/{pid}/cmdline").read().split("\0")[4]  # python -m specd serve ROLE
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        affinities = {frozenset(os.sched_getaffinity(t)) for t in threads}
        if len(available) < 2:
            assert affinities == {frozenset(available)}, role
        elif role == "target":
            assert affinities == {frozenset(available[:1])}, role
        else:
            assert affinities == {frozenset(available[1:])}, role


def _children(pid: int) -> list[int]:
    path = f"/proc/{pid}/task/{pid}/children"
    with open(path) as f:
        return [int(p) for p in f.read().split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
