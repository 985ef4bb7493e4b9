"""`specd bench --address` benchmarks the stack at that address and nothing else: it starts no
stack of its own, loads no model in-process, and says what it skipped in stable JSON keys."""

from __future__ import annotations

import json

from benchmarks import bench
from specd.cli import main
from tests.conftest import running_stack

TOP_KEYS = {"run", "modes", "sd_tokens_per_round", "verify_ms", "ssd_limit_tokens_per_s", "identical_outputs", "settings"}


def _tripwire(what: str):
    def tripped(*args, **kwargs):
        raise AssertionError(f"specd bench --address {what}")

    return tripped


def test_bench_address_runs_the_given_stack_only(tiny_pair, tmp_path, monkeypatch, capsys):
    target, draft = tiny_pair
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def main():\n", "import os\n"]))
    out = tmp_path / "bench.json"
    monkeypatch.setattr("subprocess.Popen", _tripwire("started a process"))
    monkeypatch.setattr(bench, "HFAssisted", _tripwire("loaded models in-process"))
    with running_stack(target, draft) as stack:
        code = main(["bench", "--address", stack.address, "--prompts", str(prompts), "--max-new-tokens", "6",
                     "--repeats", "1", "--tracing-overhead", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result) == TOP_KEYS  # no "tracing": its stacks would be stacks of its own
    assert set(result["modes"]) == {"off", "sd", "ssd", "hf_assisted"}
    keys = {mode: set(figures) for mode, figures in result["modes"].items()}
    assert all(k == keys["off"] for k in keys.values()), keys
    hf = result["modes"]["hf_assisted"]
    assert "--address" in hf["skipped"] and hf["tokens_per_s"] is None
    for mode in ("off", "sd", "ssd"):
        assert result["modes"][mode]["skipped"] is None and result["modes"][mode]["tokens_per_s"] > 0, mode
    assert result["verify_ms"] is None and result["ssd_limit_tokens_per_s"] is None
    assert result["identical_outputs"] is True
    assert result["settings"]["target"] == target and result["settings"]["draft"] == draft
    assert result["settings"]["address"] == stack.address
    captured = capsys.readouterr()
    assert "hf_assisted skipped" in captured.err and "--tracing-overhead skipped" in captured.err
    assert "hf_assisted skipped:" in captured.out


def test_bench_address_reports_a_skipped_mode_beside_a_draftless_stack(tiny_pair, tmp_path, monkeypatch):
    target, _ = tiny_pair
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["x = 1\n"]))
    out = tmp_path / "bench.json"
    monkeypatch.setattr("subprocess.Popen", _tripwire("started a process"))
    with running_stack(target, None) as stack:
        assert main(["bench", "--address", stack.address, "--modes", "off,hf_assisted", "--prompts", str(prompts),
                     "--max-new-tokens", "4", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"off", "hf_assisted"} and result["modes"]["hf_assisted"]["skipped"]
    assert result["settings"]["draft"] == "" and result["sd_tokens_per_round"] is None


def test_bench_against_nothing_is_one_line(capsys):
    """A stack that is not there (or goes away mid-run) ends the bench with its status, no traceback."""
    assert main(["bench", "--address", "127.0.0.1:1", "--num-prompts", "1", "--modes", "off"]) == 1
    err = capsys.readouterr().err
    assert "specd bench: 127.0.0.1:1: UNAVAILABLE: " in err and "Traceback" not in err


def test_bench_with_a_missing_prompts_file_is_one_line(capsys, tmp_path):
    assert main(["bench", "--prompts", str(tmp_path / "none.json"), "--address", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.startswith("specd bench: --prompts: ")
