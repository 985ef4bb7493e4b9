"""`specd bench`: tokens/s of target-only, sd, ssd and HF assisted generation, side by side."""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

from specd.demo import DEMO_DRAFT, DEMO_TARGET, MODELS_DIR

DEFAULT_PROMPTS = MODELS_DIR / "bench_prompts.json"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmark target-only, sd, ssd and HF assisted generation")
    parser.add_argument("--target", default=DEMO_TARGET, help="target model (default: the demo target)")
    parser.add_argument("--draft", default=DEMO_DRAFT, help="draft model (default: the demo draft)")
    parser.add_argument("--address", default="", help="use a running coordinator instead of starting a stack")
    parser.add_argument("--modes", default="off,sd,ssd,hf_assisted", help="comma-separated modes to run")
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSON list of prompt strings")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts taken from the file")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved passes over all modes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--json", dest="json_path", default="", help="write the results to this file")
    parser.set_defaults(run=run)


def start_stack(args) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "specd", "up", "--target", args.target, "--draft", args.draft,
         "--threads", str(args.threads), "--port", "0"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    for line in process.stdout:
        if line.startswith("coordinator listening on "):
            return process, line.split()[-1]
    raise RuntimeError(f"specd up exited with code {process.wait()} before serving")


def load_prompts(path: str, count: int) -> list[str]:
    prompts = json.loads(pathlib.Path(path).read_text())
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts[:count]


def run(args: argparse.Namespace) -> int:
    import grpc

    from specd import bench
    from specd.v1 import coordinator_pb2_grpc

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in bench.ALL_MODES]
    if unknown:
        print(f"specd bench: unknown modes {unknown}; choose from {', '.join(bench.ALL_MODES)}", file=sys.stderr)
        return 2
    prompts = load_prompts(args.prompts, args.num_prompts)
    stack = None
    address = args.address
    if not address:
        print("specd bench: starting the stack ...", file=sys.stderr, flush=True)
        stack, address = start_stack(args)
    hf = None
    try:
        # The in-process baseline gets the threads the two workers have together.
        hf = bench.HFAssisted(args.target, args.draft, threads=2 * args.threads)
        verify_ms = hf.verify_ms(prompts[0], args.num_speculative_tokens)
        runs: dict[str, list] = {m: [] for m in modes}
        with grpc.insecure_channel(address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            bench.run_specd_mode(stub, prompts[:1], "off", 8, args.num_speculative_tokens)  # warm-up
            for repeat in range(args.repeats):
                for mode in modes:
                    if mode == "hf_assisted":
                        result = hf.run(prompts, args.max_new_tokens)
                    else:
                        result = bench.run_specd_mode(stub, prompts, mode, args.max_new_tokens, args.num_speculative_tokens)
                    runs[mode].append(result)
                    print(f"  pass {repeat + 1}/{args.repeats} {mode:<12} {result.tokens_per_s:7.1f} tok/s",
                          file=sys.stderr, flush=True)
    finally:
        if stack is not None:
            stack.terminate()
            stack.wait(timeout=30)
    summary = {"modes": bench.summarize(runs)}
    sd = summary["modes"].get("sd")
    sd_tokens_per_round = sd["tokens_per_round"] if sd else None
    limit = sd_tokens_per_round / (verify_ms / 1000.0) if sd_tokens_per_round else None
    summary.update(
        sd_tokens_per_round=sd_tokens_per_round,
        verify_ms=verify_ms,
        ssd_limit_tokens_per_s=limit,
        identical_outputs=_identical(runs),
        settings={
            "target": args.target, "draft": args.draft, "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "num_speculative_tokens": args.num_speculative_tokens,
            "repeats": args.repeats, "threads_per_worker": args.threads, "temperature": 0.0,
        },
    )
    print(bench.format_table(summary))
    print(f"verify forward (K+1={args.num_speculative_tokens + 1} tokens, in-process): {verify_ms:.2f} ms")
    if limit:
        print(f"ssd limit = sd tokens/round {sd_tokens_per_round:.2f} / verify {verify_ms:.2f} ms = {limit:.1f} tok/s")
        if "ssd" in summary["modes"]:
            print(f"ssd reached {summary['modes']['ssd']['tokens_per_s'] / limit:.0%} of its limit")
    print("greedy outputs identical across specd modes: " + ("yes" if summary["identical_outputs"] else "NO"))
    if args.json_path:
        bench.to_json(summary, args.json_path)
    return 0


def _identical(runs: dict[str, list]) -> bool:
    outputs = [r.outputs for mode, mode_runs in runs.items() if mode in ("off", "sd", "ssd") for r in mode_runs]
    return all(o == outputs[0] for o in outputs)
