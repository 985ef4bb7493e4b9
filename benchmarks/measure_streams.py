"""Modes side by side under load, on a stack that `specd up` runs: aggregate tokens/s, each
process's CPU time, and how much the coordinator speculated.

`specd bench --concurrency` runs a level's modes minutes apart; this sends the same many-stream
load to one running stack in each mode in the order given, and also reports what the bench
does not: the CPU seconds each of the stack's processes spent (is the target saturated?) and
the coordinator's draft and cache counters over the run (did the mode speculate at all?).

    specd up 2> up.log &                 # its stderr names each process's pid and metrics port
    python benchmarks/measure_streams.py off,ssd --up-log up.log
    python benchmarks/measure_streams.py ssd,off --up-log up.log --streams 8 --passes 8
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import urllib.request

import grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from measure_ssd import cpu_seconds  # noqa: E402

from benchmarks.bench import specd_request  # noqa: E402
from benchmarks.bench_concurrency import run_streams  # noqa: E402
from coordinator.profiles import CPU  # noqa: E402
from specd.cli.bench import load_prompts  # noqa: E402
from specd.engine.default_pair import BENCH_PROMPTS  # noqa: E402
from specd.v1 import coordinator_pb2_grpc  # noqa: E402

COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
            "speculation_cache_hits_total", "speculation_cache_misses_total")


def stack_processes(up_log: str) -> tuple[dict[str, int], str]:
    """({service: pid}, the coordinator's metrics URL) from `specd up`'s stderr lines
    "the NAME (pid N) serves on ADDRESS, metrics on URL"."""
    found = re.findall(r"the (\w+) \(pid (\d+)\) serves on \S+, metrics on (\S+)", pathlib.Path(up_log).read_text())
    pids = {name: int(pid) for name, pid, _ in found}
    metrics = {name: url for name, _, url in found}
    if "coordinator" not in pids:
        raise SystemExit(f"{up_log} names no coordinator: give the stderr of a running `specd up`")
    return pids, metrics["coordinator"]


def read_counters(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return {name: float(re.search(rf"^specd_{name} (\S+)", text, re.M).group(1)) for name in COUNTERS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modes", help="comma-separated, run in this order: off, sd, ssd")
    parser.add_argument("--up-log", required=True, help="the stderr of the `specd up` serving the stack")
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--passes", type=int, default=8, help="times each stream's share of the prompt set is sent")
    parser.add_argument("--prompts", default=str(BENCH_PROMPTS))
    parser.add_argument("--count", type=int, default=8, help="how many of the prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=CPU.num_speculative_tokens)
    args = parser.parse_args()
    pids, metrics_url = stack_processes(args.up_log)
    prompts = load_prompts(args.prompts, args.count)
    stub = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(args.address))
    for mode in args.modes.split(","):
        requests = [specd_request(p, mode, args.max_new_tokens, args.k) for p in prompts * args.passes]
        counters_before, cpu_before = read_counters(metrics_url), {n: cpu_seconds(p) for n, p in pids.items()}
        results, wall_s = run_streams(stub, requests, args.streams)
        counters_after, cpu_after = read_counters(metrics_url), {n: cpu_seconds(p) for n, p in pids.items()}
        tokens = sum(r.tokens for r in results if not r.error)
        counted = ", ".join(f"{name.removesuffix('_total')} +{counters_after[name] - counters_before[name]:.0f}" for name in COUNTERS)
        cpu = ", ".join(f"{name} {cpu_after[name] - cpu_before[name]:.1f}" for name in pids)
        print(f"{mode}: {tokens / wall_s:.1f} tok/s, wall {wall_s:.1f} s, failed {sum(1 for r in results if r.error)}; "
              f"{counted}; cpu s: {cpu}", flush=True)


if __name__ == "__main__":
    main()
