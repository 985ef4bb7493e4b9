"""ssd's adaptive budget controller against a fixed budget, side by side on the default pair.

    python tools/ab_ssd_adaptive.py [--passes 3] [--num-prompts 16] [--max-new-tokens 128]

One target and one draft worker, and two coordinators in front of those same workers: A with
`--ssd-adaptive`, B with `--no-ssd-adaptive` (the fixed --ssd-budget, 16, at K = 4). The
bench prompts go through ssd, greedy, alternating A and B prompt by prompt (so the machine's
drift hits both arms alike), for several passes. Prints tokens/s per pass and per arm, and
whether both arms' greedy outputs were identical. How docs/ssd.md's A/B was measured.
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from specd import bench  # noqa: E402
from specd.cli.supervise import wait_serving  # noqa: E402
from specd.cli.up import free_port  # noqa: E402
from specd.default_pair import BENCH_PROMPTS, DEFAULT_DRAFT  # noqa: E402
from specd.v1 import coordinator_pb2_grpc  # noqa: E402

ARMS = {"A": ["--ssd-adaptive"], "B": ["--no-ssd-adaptive"]}


def start(name: str, argv: list[str], log_dir: pathlib.Path) -> tuple[subprocess.Popen, pathlib.Path]:
    log = log_dir / f"{name}.log"
    process = subprocess.Popen([sys.executable, "-m", "specd", "serve", *argv], stdout=log.open("w"),
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return process, log


def start_stack(args, log_dir: pathlib.Path, processes: list[subprocess.Popen]) -> dict[str, str]:
    """The two workers, then one coordinator per arm, each added to `processes` as it starts
    (so that a failed start still stops the others); returns arm -> address."""
    ports = {name: free_port("127.0.0.1") for name in ("target", "draft", *ARMS)}
    workers = {
        "target": ["target", "--port", str(ports["target"]), "--threads", "1", "--metrics-port", "-1"],
        "draft": ["draft", "--model", DEFAULT_DRAFT, "--port", str(ports["draft"]), "--threads", "1", "--metrics-port", "-1"],
    }
    coordinators = {
        arm: ["coordinator", "--port", str(ports[arm]), "--metrics-port", "-1", "--target-address", f"127.0.0.1:{ports['target']}",
              "--draft-address", f"127.0.0.1:{ports['draft']}", "--ssd-budget", str(args.budget),
              "--num-speculative-tokens", str(args.k), *flags]
        for arm, flags in ARMS.items()
    }
    deadline = time.monotonic() + 600
    for name, argv in {**workers, **coordinators}.items():
        process, log = start(name, argv, log_dir)
        processes.append(process)
        wait_serving(f"127.0.0.1:{ports[name]}", process, name, log, deadline)
    return {arm: f"127.0.0.1:{ports[arm]}" for arm in ARMS}


def run_passes(args, addresses: dict[str, str]) -> dict[str, list[bench.ModeRun]]:
    prompts = json.loads(BENCH_PROMPTS.read_text())[: args.num_prompts]
    stubs = {arm: coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(a)) for arm, a in addresses.items()}
    for stub in stubs.values():
        bench.add_specd_prompt(bench.ModeRun(), stub, prompts[0], "ssd", 8, args.k)  # warm-up
    passes: dict[str, list[bench.ModeRun]] = {arm: [] for arm in ARMS}
    for number in range(args.passes):
        runs = {arm: bench.ModeRun() for arm in ARMS}
        for index, prompt in enumerate(prompts):
            order = list(ARMS) if (index + number) % 2 == 0 else list(reversed(ARMS))
            for arm in order:
                bench.add_specd_prompt(runs[arm], stubs[arm], prompt, "ssd", args.max_new_tokens, args.k)
        print(f"pass {number + 1}: " + ", ".join(f"{arm} {run.tokens_per_s:6.2f} tok/s" for arm, run in runs.items()), flush=True)
        for arm, run in runs.items():
            passes[arm].append(run)
    return passes


def report(passes: dict[str, list[bench.ModeRun]]) -> None:
    for arm, runs in passes.items():
        rates = [run.tokens_per_s for run in runs]
        lookups = sum(run.cache_hits + run.cache_misses for run in runs)
        spread = statistics.stdev(rates) if len(rates) > 1 else 0.0
        print(f"{arm} ({' '.join(ARMS[arm])}): mean {statistics.mean(rates):6.2f} tok/s, min {min(rates):6.2f}, "
              f"max {max(rates):6.2f}, stdev {spread:5.2f}; hit rate {sum(r.cache_hits for r in runs) / max(1, lookups):.2f}")
    outputs = [run.outputs for runs in passes.values() for run in runs]
    print("greedy outputs identical:", all(o == outputs[0] for o in outputs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="specd-ab-"))
    processes: list[subprocess.Popen] = []
    try:
        addresses = start_stack(args, log_dir, processes)
        report(run_passes(args, addresses))
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    main()
