"""Measure ssd against sd and target-only on real worker processes (one torch thread each).

Starts a target and a draft worker once (`specd serve`, --threads 1) and one coordinator per
setting, each on the CPUs `specd up` would give it, runs the same prompts through each, the
repeats interleaving the settings, and prints per setting: tokens/s (median and spread over
the repeats), ms per round, mean acceptance length, cache hit rate, the time the loop waited
on the draft, the target's verify forward and the draft's forwards per round, and each
process's CPU milliseconds per round (on a machine with as few cores as this one, CPU spent
off the critical path still slows it).

    python benchmarks/measure_ssd.py    # the default pair; --target/--draft for another
    python benchmarks/measure_ssd.py --tiny             # the tests' tiny pair, built in a temp folder
    python benchmarks/measure_ssd.py ... --settings "ssd:ssd_budget=8" "ssd:ssd_budget=24,ssd_backup=ngram"

A setting is MODE[:field=value,...] with CoordinatorConfig fields (ssd_budget, ssd_backup,
ssd_fanout_r, ssd_saguaro_c, num_speculative_tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specd.engine.default_pair import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402
from specd.serving.cpus import cpus_flags, stack_layout  # noqa: E402
from specd.v1 import (
    common_pb2,  # noqa: E402
    coordinator_pb2_grpc,  # noqa: E402
)
from specd.v1 import coordinator_pb2 as pb  # noqa: E402

MODES = {"ssd": pb.SPECULATION_MODE_SSD, "sd": pb.SPECULATION_MODE_SD, "off": pb.SPECULATION_MODE_OFF}
PROMPTS = [
    "def parse_args(argv):\n",
    "import os\nimport sys\n\n",
    "class Cache:\n    def __init__(self, size):\n",
    "    for key, value in items:\n",
    "def read_file(path):\n    with open(path) as f:\n",
    "if __name__ == '__main__':\n",
]
DEFAULT_SETTINGS = [
    "off",
    "sd",
    "ssd:ssd_budget=0,ssd_backup=jit",
    "ssd:ssd_budget=8",
    "ssd:ssd_budget=16",
    "ssd:ssd_budget=16,ssd_backup=ngram",
    "ssd:ssd_budget=32",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(role: str, port: int, *flags: str, metrics_port: int = -1) -> subprocess.Popen:
    command = [sys.executable, "-m", "specd", "serve", role, "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", OTEL_SDK_DISABLED="true")
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_serving(port: int, process: subprocess.Popen, timeout_s: float = 300.0) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"a service on port {port} exited: {process.stderr.read().decode()[-2000:]}")
        with contextlib.suppress(grpc.RpcError):
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                return
        time.sleep(0.2)
    raise SystemExit(f"port {port} not serving after {timeout_s}s")


def _forward_totals(metrics_port: int) -> dict[str, tuple[float, float]]:
    """op -> (seconds, calls) of a worker's model forwards, from its Prometheus endpoint."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    totals: dict[str, list[float]] = {}
    for line in text.splitlines():
        for suffix, slot in (("_sum", 0), ("_count", 1)):
            prefix = f"specd_forward_seconds{suffix}{{"
            if line.startswith(prefix):
                op = line.split('op="', 1)[1].split('"', 1)[0]
                totals.setdefault(op, [0.0, 0.0])[slot] = float(line.rsplit(" ", 1)[1])
    return {op: (v[0], v[1]) for op, v in totals.items()}


def _flags(overrides: dict[str, str]) -> list[str]:
    flags = []
    for key, value in overrides.items():
        name = key.replace("_", "-")
        if value.lower() in ("true", "false"):  # booleans are --name / --no-name
            flags.append(f"--{name}" if value.lower() == "true" else f"--no-{name}")
        else:
            flags += [f"--{name}", value]
    return flags


def _parse_setting(text: str) -> tuple[str, dict[str, str]]:
    mode, _, rest = text.partition(":")
    overrides = dict(part.split("=", 1) for part in rest.split(",") if part)
    return mode, overrides


def measure(
    stub, mode: str, prompts: list[str], max_new: int, k: int, temperature: float, repeats: int, seed_base: int = 0
) -> dict:
    totals = dict(tokens=0, seconds=0.0, rounds=0, draft_tokens=0, accepted=0, hits=0, misses=0, wait_ms=0.0)
    for repeat in range(repeats):
        for i, prompt in enumerate(prompts):
            sampling = common_pb2.SamplingParams(temperature=temperature, seed=seed_base + 1000 * repeat + i)
            request = pb.GenerateRequest(
                prompt=prompt,
                sampling=sampling,
                max_new_tokens=max_new,
                ignore_eos=True,
                speculation=pb.SpeculationParams(mode=MODES[mode], num_speculative_tokens=k),
            )
            started = time.perf_counter()
            response = stub.Generate(request, timeout=300)
            totals["seconds"] += time.perf_counter() - started
            stats = response.stats
            totals["tokens"] += response.usage.completion_tokens
            totals["rounds"] += stats.rounds
            totals["draft_tokens"] += stats.draft_tokens
            totals["accepted"] += stats.accepted_tokens
            totals["hits"] += stats.cache_hits
            totals["misses"] += stats.cache_misses
            totals["wait_ms"] += stats.draft_wait_ms
    return totals


def _delta_ms(before: dict, after: dict, op: str | None, per_call: bool = False) -> float:
    """Forward milliseconds between two snapshots: one op per call, or all ops in total."""
    ops = [op] if op else list(after)
    seconds = sum(after.get(o, (0, 0))[0] - before.get(o, (0, 0))[0] for o in ops)
    calls = sum(after.get(o, (0, 0))[1] - before.get(o, (0, 0))[1] for o in ops)
    if per_call:
        return 1000.0 * seconds / calls if calls else 0.0
    return 1000.0 * seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--tiny", action="store_true", help="use the tests' tiny pair")
    parser.add_argument("--settings", nargs="*", default=DEFAULT_SETTINGS)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many prompts to use")
    parser.add_argument("--prompts-file", default="", help="a JSON list of prompts (e.g. models/smollm2-draft/bench_prompts.json)")
    args = parser.parse_args()
    if not args.tiny:
        run(args)
        return
    from tests.tiny_models import save_pair

    with tempfile.TemporaryDirectory(prefix="specd-measure-") as folder:
        args.target, args.draft = save_pair(pathlib.Path(folder))
        run(args)


def run(args) -> None:
    """Serve the pair, one coordinator per setting, and print each setting's figures."""
    target_port, draft_port = _free_port(), _free_port()
    target_metrics, draft_metrics = _free_port(), _free_port()
    # The CPUs `specd up` gives each process, so that the figures are the stack's.
    pin = cpus_flags(stack_layout(1, 1))
    workers = [
        _serve("target", target_port, "--model", args.target, "--threads", "1", "--device", "cpu",
               *pin.get("target", []), metrics_port=target_metrics),
        _serve("draft", draft_port, "--model", args.draft, "--threads", "1", "--device", "cpu",
               *pin.get("draft", []), metrics_port=draft_metrics),
    ]
    coordinators: list[subprocess.Popen] = []
    try:
        _wait_serving(target_port, workers[0])
        _wait_serving(draft_port, workers[1])
        prompts = (json.loads(pathlib.Path(args.prompts_file).read_text()) if args.prompts_file else PROMPTS)[: args.prompts]
        stubs = _start_coordinators(args.settings, target_port, draft_port, pin, coordinators)
        measure(stubs[0][2], stubs[0][1], prompts[:2], 16, args.k, args.temperature, 1)  # the workers' lazy set-up
        results = _measure_interleaved(args, prompts, stubs, coordinators, workers, (target_metrics, draft_metrics))
        _print_results(args, results)
    finally:
        for process in [*coordinators, *workers]:
            process.terminate()
            process.wait()


def _start_coordinators(
    settings: list[str], target_port: int, draft_port: int, pin: dict, coordinators: list[subprocess.Popen]
) -> list[tuple]:
    """(setting, mode, stub) of a serving coordinator per setting. Each process joins
    `coordinators` as it starts, so that the caller stops the ones started if a later one fails."""
    # One coordinator per setting, all up at once, so that the repeats can interleave the
    # settings: drift in the machine's speed then hits every setting alike.
    stubs = []
    for text in settings:
        mode, overrides = _parse_setting(text)
        port = _free_port()
        flags = ["--target-address", f"127.0.0.1:{target_port}", "--draft-address", f"127.0.0.1:{draft_port}"]
        coordinators.append(_serve("coordinator", port, "--http-port", "-1", *flags, *pin.get("coordinator", []), *_flags(overrides)))
        _wait_serving(port, coordinators[-1])
        stubs.append((text, mode, coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))))
    return stubs


def _measure_interleaved(
    args, prompts: list[str], stubs: list[tuple], coordinators: list[subprocess.Popen], workers: list[subprocess.Popen],
    metrics_ports: tuple[int, int],
) -> dict[str, list[dict]]:
    """Each setting's totals per repeat (measure's, plus CPU and forward milliseconds), the repeats
    interleaving the settings."""
    target_metrics, draft_metrics = metrics_ports
    results: dict[str, list[dict]] = {text: [] for text, _, _ in stubs}
    for repeat in range(args.repeats):
        for (text, mode, stub), coordinator in zip(stubs, coordinators):
            processes = (workers[0], workers[1], coordinator)
            cpu_before = [cpu_seconds(p.pid) for p in processes]
            before = (_forward_totals(target_metrics), _forward_totals(draft_metrics))
            t = measure(stub, mode, prompts, args.max_new, args.k, args.temperature, 1, seed_base=1000 * repeat)
            after = (_forward_totals(target_metrics), _forward_totals(draft_metrics))
            t["cpu_ms"] = [1000 * (cpu_seconds(p.pid) - b) for p, b in zip(processes, cpu_before)]
            t["verify_ms"] = _delta_ms(before[0], after[0], "verify", per_call=True)
            t["draft_ms"] = _delta_ms(before[1], after[1], None)
            results[text].append(t)
    return results


def _print_results(args, results: dict[str, list[dict]]) -> None:
    """The run's settings, then a line of figures per setting."""
    print(f"target {args.target}  draft {args.draft}  K={args.k}  T={args.temperature}  max_new={args.max_new}  "
          f"repeats={args.repeats} (interleaved)")
    print(
        f"{'setting':44s} {'tok/s':>7s} {'spread':>12s} {'ms/round':>9s} {'accept_len':>10s} {'hit_rate':>8s}"
        f" {'wait_ms/rd':>10s} {'verify_ms':>9s} {'draft_ms/rd':>11s}  cpu ms/round: target draft coordinator"
    )
    for text, runs in results.items():
        rates = [r["tokens"] / r["seconds"] for r in runs]
        total = {key: sum(r[key] for r in runs) for key in ("tokens", "seconds", "rounds", "hits", "misses", "wait_ms", "draft_ms")}
        rounds, lookups = total["rounds"], total["hits"] + total["misses"]
        cpu = [sum(r["cpu_ms"][i] for r in runs) / rounds for i in range(3)]
        print(
            f"{text:44s} {statistics.median(rates):7.1f} {min(rates):5.1f}-{max(rates):<6.1f} "
            f"{1000 * total['seconds'] / rounds:9.2f} {total['tokens'] / rounds:10.2f} "
            f"{total['hits'] / lookups if lookups else 0:8.2f} {total['wait_ms'] / rounds:10.2f} "
            f"{statistics.median(r['verify_ms'] for r in runs):9.2f} {total['draft_ms'] / rounds:11.2f}"
            f"  {cpu[0]:6.2f} {cpu[1]:6.2f} {cpu[2]:6.2f}",
            flush=True,
        )


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far, all its threads (Linux /proc)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
