"""`specd bench` end to end on the tiny pair: its own stack, every mode, the JSON other tools read.

Figures are not checked (tests never time things); the shape of the result and the greedy
identity across modes are.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

MODE_KEYS = {"tokens_per_s", "acceptance_rate", "tokens_per_round", "cache_hit_rate"}


def test_bench_runs_every_mode_and_writes_the_json(tiny_pair, tmp_path):
    target, draft = tiny_pair
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def main():\n", "import os\n"]))
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "specd", "bench", "--target", target, "--draft", draft, "--prompts", str(prompts),
         "--max-new-tokens", "12", "--repeats", "2", "--no-tracing-overhead", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    # Where the figures came from: the commit measured, the machine, the time.
    assert re.fullmatch(r"[0-9a-f]{12}", result["run"]["commit"]), result["run"]
    assert "CPUs" in result["run"]["machine"] and result["run"]["date"].endswith(" UTC")
    assert set(result["modes"]) == {"off", "sd", "ssd", "hf_assisted"}
    for mode, figures in result["modes"].items():
        assert MODE_KEYS <= set(figures), mode
        assert figures["tokens_per_s"] > 0, mode
    assert result["modes"]["off"]["cache_hit_rate"] is None and result["modes"]["sd"]["cache_hit_rate"] is None
    assert result["modes"]["hf_assisted"]["cache_hit_rate"] is None
    assert 0.0 <= result["modes"]["ssd"]["cache_hit_rate"] <= 1.0
    assert result["modes"]["off"]["tokens_per_round"] == 1.0
    assert result["modes"]["sd"]["tokens_per_round"] >= 1.0
    assert result["verify_ms"] > 0 and result["sd_tokens_per_round"] == result["modes"]["sd"]["tokens_per_round"]
    assert result["ssd_limit_tokens_per_s"] == result["sd_tokens_per_round"] / (result["verify_ms"] / 1000.0)
    for mode in ("off", "sd", "ssd"):
        figures = result["modes"][mode]
        assert figures["ms_per_round"] > figures["verify_ms_per_round"] > 0, mode
    assert result["modes"]["hf_assisted"]["ms_per_round"] is None
    assert result["identical_outputs"] is True
    assert "ssd reached" in run.stdout and "per round in the stack" in run.stdout
    assert "greedy outputs identical across specd modes: yes" in run.stdout


def test_the_table_shows_a_spread_only_between_passes():
    from benchmarks import bench

    def result(repeats, rates):
        runs = {"off": [bench.ModeRun(tokens=rate, seconds=1.0, rounds=rate) for rate in rates]}
        return {"modes": bench.summarize(runs), "settings": {"repeats": repeats}}

    one = bench.format_table(result(1, [10])).splitlines()[1].split()
    two = bench.format_table(result(2, [9, 11])).splitlines()[1].split()
    assert one[:3] == ["off", "10.0", "-"], one
    assert two[:3] == ["off", "10.0", "9.0-11.0"], two
