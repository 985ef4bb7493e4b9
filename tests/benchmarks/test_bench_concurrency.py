"""`specd bench --concurrency`: the JSON's `concurrency` block on the tiny pair, and its flag's errors.

Figures are not checked (tests never time things): the shape is, and that `modes` keeps its
keys beside it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.bench_concurrency import palindromic_passes
from specd.cli import main

LEVEL_KEYS = {"tokens_per_s", "p50_latency_s", "p99_latency_s", "p50_ttft_s"}
MODE_KEYS = {"tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "acceptance_rate", "tokens_per_round",
             "cache_hit_rate", "ms_per_round", "verify_ms_per_round", "skipped"}


def test_bench_concurrency_levels_in_the_json(tiny_pair, tmp_path):
    target, draft = tiny_pair
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def main():\n", "import os\n", "class A:\n"]))
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "specd", "bench", "--target", target, "--draft", draft, "--prompts", str(prompts),
         "--modes", "off,sd,ssd", "--concurrency", "1,3", "--max-new-tokens", "8", "--repeats", "1",
         "--no-tracing-overhead", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"off", "sd", "ssd"}
    for figures in result["modes"].values():
        assert set(figures) == MODE_KEYS
    assert set(result["concurrency"]) == {"1", "3"}
    for level, entry in result["concurrency"].items():
        assert set(entry) == {"modes"}
        assert set(entry["modes"]) == {"off", "sd", "ssd"}
        for mode, figures in entry["modes"].items():
            assert LEVEL_KEYS <= set(figures), (level, mode)
            assert figures["failed_requests"] == 0 and figures["requests"] == 3 * int(level), (level, mode)
            assert figures["tokens_per_s"] > 0
            assert 0 < figures["p50_latency_s"] <= figures["p99_latency_s"], (level, mode)
            assert 0 < figures["p50_ttft_s"] <= figures["p99_latency_s"], (level, mode)
    assert "concurrent client streams" in run.stdout


@pytest.mark.parametrize("levels", ["0", "1,x", ""])
def test_a_bad_concurrency_is_one_line_naming_the_flag(levels, capsys):
    assert main(["bench", "--concurrency", levels]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specd bench: --concurrency ")


def test_a_level_runs_its_modes_in_order_then_in_reverse():
    passes = palindromic_passes(["off", "sd", "ssd"], 17)
    assert [mode for mode, _ in passes] == ["off", "sd", "ssd", "ssd", "sd", "off"]
    for mode in ("off", "sd", "ssd"):
        sent = [i for m, part in passes if m == mode for i in range(17)[part]]
        assert sent == list(range(17)), mode  # every request once, none twice


def test_a_single_request_is_one_pass_per_mode():
    assert palindromic_passes(["off", "ssd"], 1) == [("off", slice(0, 1)), ("ssd", slice(0, 1))]
