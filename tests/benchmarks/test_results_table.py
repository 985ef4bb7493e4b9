"""benchmarks/results_table.py: a bench JSON as the results table, stamped with where it came from."""

from __future__ import annotations

from benchmarks.results_table import markdown


def _mode(tokens_per_s: float, **figures) -> dict:
    return {"tokens_per_s": tokens_per_s, "tokens_per_round": None, "acceptance_rate": None, "cache_hit_rate": None,
            "skipped": None, **figures}


def test_the_table_names_its_run_and_ratios_to_off():
    result = {
        "run": {"commit": "0123456789ab", "machine": "2 CPUs (x), torch 2.13.0+cpu", "date": "2026-11-29 07:33 UTC"},
        "settings": {"prompts": 8, "max_new_tokens": 128, "num_speculative_tokens": 3, "threads_per_worker": 1},
        "identical_outputs": True,
        "modes": {
            "off": _mode(10.0, tokens_per_round=1.0),
            "ssd": _mode(17.5, tokens_per_round=2.49, acceptance_rate=0.515, cache_hit_rate=0.66),
            "hf_assisted": {**_mode(None), "skipped": "runs in-process"},
        },
    }
    text = markdown(result, "specd bench --json b.json")
    assert "| ssd | 17.5 | 1.75 | 2.49 | 0.515 | 0.66 |" in text
    assert "| hf_assisted | skipped: runs in-process |" in text
    assert "`specd bench --json b.json` at commit 0123456789ab, 2026-11-29 07:33 UTC, on 2 CPUs (x)" in text
    assert "K = 3" in text and "identical across modes: yes" in text
