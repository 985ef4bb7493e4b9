"""Write `specd bench`'s prompts from the held-out side of the draft recipe's stdlib split.

Code completion and chat alternate (so any leading slice of the file holds both kinds): code
prompts are windows of held-out files, chat prompts are requests the recipe writes from the
held-out files' functions and classes, rendered with the target's chat template (so the bench,
HF assisted generation included, sends every prompt as plain text). The split and the prompt
shapes are the recipe's (recipes/draft_data.py), with another seed: no prompt the draft trained on.
Written once to models/smollm2-draft/bench_prompts.json, so every machine benchmarks the same text.

    python benchmarks/make_bench_prompts.py [--count 16]
"""

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MIN_PROMPT_CHARS = 240
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))

import draft_data  # noqa: E402

from specd.engine.default_pair import BENCH_PROMPTS, DEFAULT_TARGET  # noqa: E402
from specd.engine.loading import load_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--heldout-percent", type=int, default=5, help="as the draft recipe's")
    parser.add_argument("--max-prompt-tokens", type=int, default=200)
    args = parser.parse_args()
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    sources = draft_data.read_split(args.heldout_percent, heldout=True)
    definitions = draft_data.all_definitions(sources)
    kinds = {}
    for kind, fraction in (("code", 0.0), ("chat", 1.0)):
        drawn = draft_data.make_prompts(tokenizer, sources, definitions, 4 * args.count, args.seed, fraction, args.max_prompt_tokens)
        # A whole tiny file (a one-line shim) is a poor completion prompt: keep windows of substance.
        texts = dict.fromkeys(p["text"] for p in drawn if len(p["text"]) >= MIN_PROMPT_CHARS)  # unique, in order
        kinds[kind] = list(texts)[: args.count // 2]
    prompts = [text for pair in zip(kinds["code"], kinds["chat"]) for text in pair]
    BENCH_PROMPTS.write_text(json.dumps(prompts, indent=1) + "\n")
    print(f"{len(prompts)} prompts (code and chat alternating) from {len(sources)} held-out files -> {BENCH_PROMPTS}")


if __name__ == "__main__":
    main()
