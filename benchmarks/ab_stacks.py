"""Whole `specd up` stacks side by side: one per arm, each from its own checkout if asked.

    python benchmarks/ab_stacks.py --arm "before@/path/to/other/checkout=" --arm "after=" [--passes 3]

benchmarks/ab_ssd.py puts several coordinators in front of one pair of workers; a change to a worker
needs a stack of its own. Each arm here is a `specd up` (this checkout's code, or with @TREE
another checkout's: PYTHONPATH=TREE, run from TREE, so its default draft is TREE's too) given the
arm's `specd up` flags after "=". Every stack pins its services as `specd up` does; the stacks
share the CPUs, so only one serves at a time: the bench prompts go to every arm in turn (the
order rotating), greedy, ssd (or --mode), so the machine's drift hits every arm alike. Prints tokens/s per
pass and per arm, and whether every arm's greedy outputs were identical.
"""

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from ab_ssd import add_request_options, parse_arm, report, run_passes  # noqa: E402  (benchmarks/, this script's folder)

from coordinator.profiles import CPU  # noqa: E402
from specd.cli.supervise import stop_processes, wait_serving  # noqa: E402
from specd.cli.up import free_port  # noqa: E402


def start_stack(name: str, tree: str, flags: list[str], log_dir: pathlib.Path) -> tuple[subprocess.Popen, str, pathlib.Path]:
    """`specd up` for one arm: its process, its coordinator's address and its log."""
    port = free_port("127.0.0.1")
    log = log_dir / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": tree} if tree else None
    argv = [sys.executable, "-m", "specd", "up", "--port", str(port), "--metrics-port", "-1", "--http-port", "-1",
            "--log-dir", str(log_dir / name), *flags]
    process = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env=env, cwd=tree or None)
    return process, f"127.0.0.1:{port}", log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", action="append", required=True, help="NAME[@TREE]=SPECD UP FLAGS (repeat: two or more)")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=CPU.num_speculative_tokens, help="K each request asks for")
    add_request_options(parser)
    args = parser.parse_args()
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="specd-ab-stacks-"))
    print(f"logs in {log_dir}", flush=True)
    processes: list[subprocess.Popen] = []
    try:
        addresses = {}
        for name, tree, flags in map(parse_arm, args.arm):
            process, addresses[name], log = start_stack(name, tree, flags, log_dir)
            processes.append(process)  # before the wait: a stack that fails to serve is stopped too
            wait_serving(addresses[name], process, f"stack {name}", log, time.monotonic() + 600)
        report(run_passes(args, addresses))
    finally:
        stop_processes(processes, timeout_s=60)  # `specd up` stops its services on SIGTERM


if __name__ == "__main__":
    main()
