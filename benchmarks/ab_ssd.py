"""ssd coordinators side by side on one pair of workers (the default pair, or --target/--draft).

    python benchmarks/ab_ssd.py --arm "NAME[@TREE]=FLAGS" --arm ... [--passes 3] [--num-prompts 16]

One target and one draft worker (this checkout's code; the default pair unless --target and
--draft name another), and one coordinator per arm in front
of those same workers, each service on the CPUs `specd up` would give it, each coordinator
with the arm's flags (besides --ssd-budget and --num-speculative-tokens, 16 and 4 unless
given) and, with @TREE, run from another checkout's code (PYTHONPATH=TREE): settings or
coordinator code before and after a change, in one run (benchmarks/ab_stacks.py for the workers').
The bench prompts go through ssd (or --mode), greedy, 128 new tokens, each prompt to every arm in turn (the
order rotating), so the machine's drift hits every arm alike, for several passes. Prints
tokens/s per pass and per arm, and whether every arm's greedy outputs were identical. How the
default budget was chosen (docs/decisions.md):

    python benchmarks/ab_ssd.py --passes 3 --num-prompts 8 --arm "b5=--ssd-budget 5" --arm "b6=--ssd-budget 6" --arm "b8=--ssd-budget 8"
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from benchmarks import bench  # noqa: E402
from specd.cli.supervise import stop_processes, wait_serving  # noqa: E402
from specd.cli.up import free_port  # noqa: E402
from specd.engine.default_pair import BENCH_PROMPTS, DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402
from specd.serving.cpus import cpus_flags, stack_layout  # noqa: E402
from specd.v1 import coordinator_pb2_grpc  # noqa: E402


def parse_arm(text: str) -> tuple[str, str, list[str]]:
    """NAME[@TREE]=FLAGS -> (name, tree or "", flags)."""
    head, _, flags = text.partition("=")
    name, _, tree = head.partition("@")
    return name, tree, flags.split()


def start(name: str, argv: list[str], log_dir: pathlib.Path, tree: str = "") -> tuple[subprocess.Popen, pathlib.Path]:
    log = log_dir / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": tree} if tree else None
    process = subprocess.Popen([sys.executable, "-m", "specd", "serve", *argv], stdout=log.open("w"),
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=tree or None)
    return process, log


def start_stack(args, log_dir: pathlib.Path, processes: list[subprocess.Popen]) -> dict[str, str]:
    """The two workers, then one coordinator per arm, each added to `processes` as it starts
    (so that a failed start still stops the others); returns arm -> address."""
    arms = {name: (tree, flags) for name, tree, flags in map(parse_arm, args.arm)}
    ports = {name: free_port("127.0.0.1") for name in ("target", "draft", *arms)}
    workers = {
        "target": ["target", "--model", args.target, "--port", str(ports["target"]), "--threads", "1", "--metrics-port", "-1"],
        "draft": ["draft", "--model", args.draft, "--port", str(ports["draft"]), "--threads", "1", "--metrics-port", "-1"],
    }
    coordinators = {
        arm: ["coordinator", "--port", str(ports[arm]), "--metrics-port", "-1", "--http-port", "-1", "--target-address", f"127.0.0.1:{ports['target']}",
              "--draft-address", f"127.0.0.1:{ports['draft']}", "--ssd-budget", str(args.budget),
              "--num-speculative-tokens", str(args.k), *flags]
        for arm, (_, flags) in arms.items()
    }
    # Each service on the CPUs `specd up` would give it: the target on its own, the rest beside
    # ({} where no CPU is left beside the target).
    pin = cpus_flags(stack_layout(1, 1))
    for name, argv in workers.items():
        argv += pin.get(name, [])
    for argv in coordinators.values():
        argv += pin.get("coordinator", [])
    deadline = time.monotonic() + 600
    for name, argv in {**workers, **coordinators}.items():
        process, log = start(name, argv, log_dir, arms[name][0] if name in arms else "")
        processes.append(process)
        wait_serving(f"127.0.0.1:{ports[name]}", process, name, log, deadline)
    return {arm: f"127.0.0.1:{ports[arm]}" for arm in arms}


def add_request_options(parser: argparse.ArgumentParser) -> None:
    """What run_passes sends: --prompts, --mode, --stream."""
    parser.add_argument("--prompts", default=str(BENCH_PROMPTS), help="JSON list of prompt strings (default: the default pair's bench prompts)")
    parser.add_argument("--stream", action="store_true", help="GenerateStream calls, read to their end, instead of Generate")
    parser.add_argument("--mode", choices=("off", "sd", "ssd"), default="ssd", help="the mode every request asks for")


def run_passes(args, addresses: dict[str, str]) -> dict[str, list[bench.ModeRun]]:
    prompts = json.loads(pathlib.Path(args.prompts).read_text())[: args.num_prompts]
    stubs = {arm: coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(a)) for arm, a in addresses.items()}
    for stub in stubs.values():
        bench.add_specd_prompt(bench.ModeRun(), stub, prompts[0], args.mode, 8, args.k)  # warm-up
    names = list(addresses)
    passes: dict[str, list[bench.ModeRun]] = {arm: [] for arm in names}
    for number in range(args.passes):
        runs = {arm: bench.ModeRun() for arm in names}
        for index, prompt in enumerate(prompts):
            turn = (index + number) % len(names)
            for arm in names[turn:] + names[:turn]:
                bench.add_specd_prompt(runs[arm], stubs[arm], prompt, args.mode, args.max_new_tokens, args.k, args.stream)
        print(f"pass {number + 1}: " + ", ".join(f"{arm} {run.tokens_per_s:6.2f} tok/s" for arm, run in runs.items()), flush=True)
        for arm, run in runs.items():
            passes[arm].append(run)
    return passes


def report(passes: dict[str, list[bench.ModeRun]]) -> None:
    for arm, runs in passes.items():
        rates = [run.tokens_per_s for run in runs]
        lookups = sum(run.cache_hits + run.cache_misses for run in runs)
        spread = statistics.stdev(rates) if len(rates) > 1 else 0.0
        print(f"{arm}: mean {statistics.mean(rates):6.2f} tok/s, min {min(rates):6.2f}, "
              f"max {max(rates):6.2f}, stdev {spread:5.2f}; hit rate {sum(r.cache_hits for r in runs) / max(1, lookups):.2f}")
    outputs = [run.outputs for runs in passes.values() for run in runs]
    print("greedy outputs identical:", all(o == outputs[0] for o in outputs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", action="append", required=True, help="NAME[@TREE]=COORDINATOR FLAGS (repeat: two or more)")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=16)
    add_request_options(parser)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="the target worker's model (default: the default pair's)")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="the draft worker's model (default: the default pair's)")
    args = parser.parse_args()
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="specd-ab-"))
    processes: list[subprocess.Popen] = []
    try:
        addresses = start_stack(args, log_dir, processes)
        report(run_passes(args, addresses))
    finally:
        stop_processes(processes, timeout_s=30)


if __name__ == "__main__":
    main()
