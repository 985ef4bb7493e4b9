"""The markdown results table of a `specd bench --json` file, stamped with its commit, machine and
date: what docs/results.md and the README's results section hold.

    python benchmarks/results_table.py bench.json > docs/results.md
"""

from __future__ import annotations

import argparse
import json
import pathlib

COLUMNS = ("tokens/s", "x off", "tokens per round", "acceptance", "cache hit rate")


def markdown(result: dict, command: str) -> str:
    """The run's table: one row per mode, then where it came from."""
    off = result["modes"].get("off", {}).get("tokens_per_s")
    rows = ["| mode | " + " | ".join(COLUMNS) + " |", "| --- |" + " --- |" * len(COLUMNS)]
    for mode, m in result["modes"].items():
        if m.get("skipped"):
            rows.append(f"| {mode} | skipped: {m['skipped']} |" + " |" * (len(COLUMNS) - 1))
            continue
        cells = (
            _fmt(m["tokens_per_s"], ".1f"),
            _fmt(m["tokens_per_s"] / off if off else None, ".2f"),
            _fmt(m["tokens_per_round"], ".2f"),
            _fmt(m["acceptance_rate"], ".3f"),
            _fmt(m["cache_hit_rate"], ".2f"),
        )
        rows.append(f"| {mode} | " + " | ".join(cells) + " |")
    run, settings = result.get("run", {}), result.get("settings", {})
    source = (
        f"`{command}` at commit {run.get('commit', 'unknown')}, {run.get('date', 'date unknown')}, on "
        f"{run.get('machine', 'an unknown machine')}: {settings.get('prompts')} bench prompts x "
        f"{settings.get('max_new_tokens')} new tokens, greedy, K = {settings.get('num_speculative_tokens')}, "
        f"{settings.get('threads_per_worker')} thread per worker; greedy outputs identical across modes: "
        f"{'yes' if result.get('identical_outputs') else 'NO'}."
    )
    return "\n".join(rows) + "\n\n" + source + "\n"


def _fmt(value, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json_file", type=pathlib.Path, help="a `specd bench --json` file")
    parser.add_argument("--command", default="specd bench --json bench.json", help="the command that wrote it (default: %(default)s)")
    args = parser.parse_args()
    print("# Results\n")
    print("The current `specd bench` figures on the default pair; tokens/s of one request at a time. To take them")
    print("again: `specd bench --json bench.json`, then `python benchmarks/results_table.py bench.json > docs/results.md`.\n")
    print(markdown(json.loads(args.json_file.read_text()), args.command), end="")


if __name__ == "__main__":
    main()
