"""K side by side: one `specd up` stack on the default pair, the bench prompts through each mode
at each K, interleaved prompt by prompt (so the machine's drift hits every K alike).

    python benchmarks/sweep_k.py --ks 3,4,5,6 [--modes sd,ssd] [--repeats 1] [--num-prompts 8]

Prints per mode and K: tokens/s, tokens per round, acceptance, cache hit rate, ms per round and
the target's verify ms per round, target-only once beside them, and whether every greedy output
was identical. How the default K was chosen (docs/decisions.md).
"""

import argparse
import json
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks import bench  # noqa: E402
from specd.cli.bench import _stub, start_stack  # noqa: E402
from specd.engine.default_pair import BENCH_PROMPTS, DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="3,4,5,6")
    parser.add_argument("--modes", default="sd,ssd")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="auto", help="the stack's device (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", help="the stack's weights dtype (default: %(default)s)")
    args = parser.parse_args()
    prompts = json.loads(BENCH_PROMPTS.read_text())[: args.num_prompts]
    cells = [("off", 1)] + [(mode, int(k)) for mode in args.modes.split(",") for k in args.ks.split(",")]
    runs = {cell: bench.ModeRun() for cell in cells}
    stack, address = start_stack(args)
    try:
        stub = _stub(address, None)  # the stack it started: plaintext on loopback
        bench.add_specd_prompt(bench.ModeRun(), stub, prompts[0], "off", 8, 4)  # warm-up
        for _ in range(args.repeats):
            for index, prompt in enumerate(prompts):
                for mode, k in cells[index % len(cells):] + cells[: index % len(cells)]:
                    bench.add_specd_prompt(runs[(mode, k)], stub, prompt, mode, args.max_new_tokens, k)
    finally:
        stack.terminate()
        try:
            stack.wait(timeout=60)
        except subprocess.TimeoutExpired:
            stack.kill()
    for (mode, k), run in runs.items():
        rounds, lookups = max(1, run.rounds), run.cache_hits + run.cache_misses
        print(f"{mode:<4} K={k}: {run.tokens_per_s:6.2f} tok/s, tokens/round {run.tokens / rounds:.2f}, "
              f"accept {run.accepted_tokens / max(1, run.draft_tokens):.3f}, hit {run.cache_hits / lookups if lookups else 0:.2f}, "
              f"ms/round {run.seconds * 1000 / rounds:.1f}, verify ms/round {run.verify_ms / rounds:.1f}")
    print("greedy outputs identical:", all(run.outputs == runs[("off", 1)].outputs for run in runs.values()))


if __name__ == "__main__":
    main()
