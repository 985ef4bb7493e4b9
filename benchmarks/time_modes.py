"""Seconds one Generate takes in each mode, with and without a repetition penalty, on a stack
that `specd up` runs: the README's "Calling Generate" table.

Each request is the one `specd generate` builds for the same flags (a chat, "Write a short story
about a robot who learns to paint.", and a code start), sent one at a time and timed around the
Generate call; each setting `--repeats` times, modes in the order given.

    specd up &
    python benchmarks/time_modes.py --address 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specd.cli import generate  # noqa: E402
from specd.v1 import coordinator_pb2_grpc  # noqa: E402

PROMPTS = {  # name: the `specd generate` arguments that send it
    "story": ["Write a short story about a robot who learns to paint.", "--chat"],
    "code": ["import json\n\ndef load_config(path):"],
}


def generate_request(prompt_args: list[str], mode: str, penalty: str, max_new_tokens: int):
    """The GenerateRequest `specd generate PROMPT_ARGS --mode M [--repetition-penalty P]` sends."""
    parser = argparse.ArgumentParser()
    generate.add_parser(parser.add_subparsers())
    flags = ["--mode", mode, "--max-new-tokens", str(max_new_tokens)]
    if penalty != "none":
        flags += ["--repetition-penalty", penalty]
    return generate.build_request(parser.parse_args(["generate", *prompt_args, *flags]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--modes", default="auto,ssd,off", help="comma-separated, run in this order")
    parser.add_argument("--penalties", default="none,1.2", help="comma-separated repetition penalties (none: unset)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    modes = args.modes.split(",")
    stub = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(args.address))
    rows = []
    for name, prompt_args in PROMPTS.items():
        for penalty in args.penalties.split(","):
            cells = []
            for mode in modes:
                request = generate_request(prompt_args, mode, penalty, args.max_new_tokens)
                seconds = []
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    reply = stub.Generate(request, timeout=600)
                    seconds.append(time.perf_counter() - started)
                print(f"{name}, penalty {penalty}, {mode}: {', '.join(f'{s:.2f}' for s in seconds)} s "
                      f"({reply.usage.completion_tokens} tokens, {reply.stats.rounds} rounds)", flush=True)
                cells.append(", ".join(f"{s:.2f}" for s in seconds))
            rows.append(f"| {name}, {'no penalty' if penalty == 'none' else f'penalty {penalty}'} | " + " | ".join(cells) + " |")
    print("| | " + " | ".join(f"`{m}`" for m in modes) + " |\n| --- |" + " --- |" * len(modes))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
