"""Cut `specd bench`'s prompts from the demo pair's held-out stdlib files.

Each prompt is the start of one top-level `def` or `class` of a held-out file, through its
first lines (up to ~PROMPT_CHARS characters), so the model continues real, unseen code.
Written once to models/demo/bench_prompts.json, so every machine benchmarks the same text.

    python tools/make_bench_prompts.py [--count 16]
"""

import argparse
import json
import pathlib
import re
import sysconfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEMO = ROOT / "models" / "demo"
PROMPT_CHARS = 320
DEFINITION = re.compile(r"^(def|class) \w+", re.MULTILINE)


def prompts_from(source: str, per_file: int) -> list[str]:
    prompts = []
    for match in DEFINITION.finditer(source):
        chunk = source[match.start() : match.start() + PROMPT_CHARS]
        chunk = chunk[: chunk.rfind("\n") + 1]  # whole lines only
        if chunk.count("\n") >= 3:
            prompts.append(chunk)
        if len(prompts) == per_file:
            break
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--per-file", type=int, default=1)
    args = parser.parse_args()
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [line for line in (DEMO / "heldout_files.txt").read_text().splitlines() if line and not line.startswith("#")]
    prompts: list[str] = []
    for rel in files:
        path = stdlib / rel
        if path.exists() and not rel.startswith(("encodings/", "idlelib/", "turtledemo/")):
            prompts.extend(prompts_from(path.read_text(encoding="utf-8", errors="replace"), args.per_file))
    prompts = prompts[: args.count]
    (DEMO / "bench_prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
    print(f"{len(prompts)} prompts from {len(files)} held-out files -> {DEMO / 'bench_prompts.json'}")


if __name__ == "__main__":
    main()
