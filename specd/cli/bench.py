"""`specd bench`: tokens/s of target-only, sd, ssd and HF assisted generation, side by side."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from specd.cli import connect
from specd.cli.supervise import stop_processes
from specd.cli.up import runs_on_gpu
from specd.engine.default_pair import BENCH_PROMPTS, DEFAULT_DRAFT, DEFAULT_TARGET
from specd.serving.cpus import describe_cpus, format_cpu_list, stack_layout
from specd.wire.modes import OFF, SD, SSD


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmark target-only, sd, ssd and HF assisted generation")
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help="target model folder or hub id (default: the default pair's, %(default)s)")
    parser.add_argument("--draft", default=DEFAULT_DRAFT,
                        help="draft model folder or hub id (default: the default pair's, %(default)s)")
    parser.add_argument("--address", default="",
                        help="benchmark the running coordinator at HOST:PORT only: no stack of its own, and no "
                             "hf_assisted or verify timing (they run local models in this process; default: start a "
                             "stack of --target and --draft with `specd up`, and stop it at the end)")
    parser.add_argument("--modes", default="off,sd,ssd,hf_assisted",
                        help="comma-separated modes to run (default: %(default)s)")
    parser.add_argument("--prompts", default=str(BENCH_PROMPTS),
                        help="JSON list of prompt strings (chat prompts rendered with the chat template; default: the "
                             "default pair's bench prompts, %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=8,
                        help="prompts taken from the start of the file (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="most tokens generated per prompt in each mode (default: %(default)s)")
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=None,
                        help="K, draft tokens per round (default: the coordinator's, as its ModelInfo says)")
    # One pass and no tracing stacks by default: the default run stays within 10 minutes on a
    # 2-core machine, where two passes did not. Drift is handled inside a pass: a prompt's modes
    # run seconds apart.
    parser.add_argument("--repeats", type=int, default=1,
                        help="passes over all prompts, each prompt through every mode in turn (default 1; "
                             "more give the spread of tokens/s between passes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default: %(default)s)")
    parser.add_argument("--device", default="auto",
                        help="the stack's device, and HF assisted generation's and the verify timing's (default: "
                             "%(default)s: cuda where torch sees a GPU, else cpu)")
    parser.add_argument("--dtype", default="auto",
                        help="weights dtype of the stack and of the in-process models (default: %(default)s: float32 "
                             "on a CPU, bfloat16 on a GPU)")
    # Default 1: the run above, one request at a time, whose figures are `modes`; the JSON gets a
    # `concurrency` block only when levels are named.
    parser.add_argument("--concurrency", default=None,
                        help="client streams at once, comma-separated levels like 1,4,8 (default 1: one at a time, as "
                             "`modes` reports): off, sd and ssd (those in --modes) also run at each level with that "
                             "many concurrent GenerateStream clients, reported under `concurrency` in the JSON")
    parser.add_argument("--tracing-overhead", action=argparse.BooleanOptionalAction, default=False,
                        help="also run ssd on a stack with tracing disabled and one exporting every span (default: off)")
    parser.add_argument("--json", dest="json_path", default="", help="write the results to this file as JSON (default: none; the table goes to stdout either way)")
    connect.add_arguments(parser)  # TLS and token for the coordinator at --address
    parser.set_defaults(run=run)


def start_stack(args, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "specd", "up", "--target", args.target, "--draft", args.draft,
         "--threads", str(args.threads), "--device", args.device, "--dtype", args.dtype, "--port", "0", "--metrics-port", "0"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
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


# What `--address` leaves out: a stack benchmarked by address is that stack only.
ADDRESS_SKIPS = {
    "hf_assisted": "runs the pair in this process, from local models; with --address only that stack is benchmarked",
}


def benchmarks_on_path() -> bool:
    """`specd bench` runs the benchmarks of the checkout it is installed from (benchmarks/ beside
    specd/, not an installed package): put that folder's parent on the path. False if there is none."""
    root = pathlib.Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "bench.py").is_file():
        return False
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return True


def run(args: argparse.Namespace) -> int:
    import grpc

    if not benchmarks_on_path():
        print("specd bench: it runs from a checkout of specd (benchmarks/ beside specd/); install specd with "
              "`pip install -e .` from one", file=sys.stderr)
        return 2
    from benchmarks import bench

    try:
        modes, levels, prompts = _inputs(args)
    except ValueError as exc:
        print(f"specd bench: {exc}", file=sys.stderr)
        return 2
    skipped = {m: reason for m, reason in ADDRESS_SKIPS.items() if args.address and m in modes}
    modes = [m for m in modes if m not in skipped]
    for mode, reason in skipped.items():
        print(f"specd bench: {mode} skipped: {reason}", file=sys.stderr, flush=True)
    if args.address and args.tracing_overhead:
        print("specd bench: --tracing-overhead skipped: it starts stacks of its own, and --address benchmarks "
              "that stack only", file=sys.stderr, flush=True)
    stacks: list[subprocess.Popen] = []
    traced_addresses: dict[str, str] = {}
    receiver = None
    try:
        if args.address:
            address = args.address
        else:
            print("specd bench: starting the stack ...", file=sys.stderr, flush=True)
            stack, address = start_stack(args)
            stacks.append(stack)
            if args.tracing_overhead and SSD in modes:
                receiver = start_traced_stacks(args, stacks, traced_addresses)
        if args.num_speculative_tokens is None:
            args.num_speculative_tokens = _default_k(address, args)
        runs, verify_times, target_cpus = run_passes(args, modes, prompts, address, traced_addresses)
        concurrency = run_concurrency(args, levels, modes, prompts, address)
    except grpc.RpcError as exc:  # the stack went away or refused a request: no figures to report
        print(f"specd bench: {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        stop_processes(stacks, timeout_s=60)
        if receiver is not None:
            receiver.stop()
    summary = build_summary(args, runs, traced_addresses, skipped, verify_times, target_cpus, len(prompts), address)
    if levels:
        summary["concurrency"] = concurrency
    report(summary, args, len(verify_times), target_cpus)
    if args.json_path:
        bench.to_json(summary, args.json_path)
    return 0


def _inputs(args: argparse.Namespace) -> tuple[list[str], list[int], list[str]]:
    """The modes, concurrency levels and prompts the flags ask for; ValueError says which flag is wrong."""
    from benchmarks import bench, bench_concurrency

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in bench.ALL_MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {', '.join(bench.ALL_MODES)}")
    levels = bench_concurrency.parse_levels(args.concurrency) if args.concurrency is not None else []
    try:
        prompts = load_prompts(args.prompts, args.num_prompts)
    except (OSError, ValueError) as exc:  # ValueError: not the JSON list of prompts it must be
        raise ValueError(f"--prompts: {exc}") from None
    return modes, levels, prompts


def start_traced_stacks(args, stacks: list, traced_addresses: dict[str, str]):
    """ssd through stacks that differ only in tracing: SDK disabled, and exporting every span
    to a receiver (returned, to be stopped with them)."""
    from specd.cli.trace_store import Receiver

    receiver = Receiver(pathlib.Path(tempfile.mkdtemp(prefix="specd-bench-")) / "spans.jsonl", port=0).start()
    for name, env in (
        ("ssd_tracing_disabled", {"OTEL_SDK_DISABLED": "true"}),
        ("ssd_tracing_exported", {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                                  "OTEL_TRACES_SAMPLER": "always_on"}),
    ):
        print(f"specd bench: starting a stack for {name} ...", file=sys.stderr, flush=True)
        stack, traced_addresses[name] = start_stack(args, env)
        stacks.append(stack)
    return receiver


def run_passes(args, modes: list[str], prompts: list[str], address: str, traced_addresses: dict[str, str]):
    """Every pass over the prompts through every mode: (runs per mode, verify times, target CPUs).
    The in-process parts (HF assisted, the verify forward timing) need local models: a stack
    given by --address gets neither."""
    from benchmarks import bench

    local = not args.address
    # The limit's verify forward is timed where the stack's target runs: on the CPUs specd up pins
    # it to on a CPU host, on the GPU on a GPU host.
    target_cpus = stack_layout(args.threads).get("target") if local and not runs_on_gpu(args.device) else None
    # The in-process baseline gets the threads the two workers have together.
    hf = bench.HFAssisted(args.target, args.draft, 2 * args.threads, args.threads, args.device, args.dtype,
                          assisted="hf_assisted" in modes) if local else None
    if hf is not None:  # what auto resolved to, for the JSON
        args.device, args.dtype = str(hf.device), hf.dtype
    verify_times: list[float] = []  # taken in every pass, under the load the modes see
    runs: dict[str, list] = {m: [] for m in [*modes, *traced_addresses]}
    # TLS and the token are the --address stack's; the stacks started here serve plaintext.
    stubs = {name: _stub(addr, args if name == "specd" and args.address else None)
             for name, addr in {"specd": address, **traced_addresses}.items()}
    for stub in stubs.values():
        bench.add_specd_prompt(bench.ModeRun(), stub, prompts[0], OFF, 8, args.num_speculative_tokens)  # warm-up
    for repeat in range(args.repeats):
        passes = {mode: bench.ModeRun() for mode in runs}
        # Prompt by prompt through every mode, in an order that turns with the prompt: the
        # modes' times for a prompt lie seconds apart, so the machine's drift hits all alike.
        for index, prompt in enumerate(prompts):
            if hf is not None:
                verify_times += hf.verify_times_ms([prompt], args.num_speculative_tokens, args.max_new_tokens // 2,
                                                   cpus=target_cpus)
            order = list(runs)
            for mode in order[index % len(order):] + order[: index % len(order)]:
                if mode == "hf_assisted":
                    hf.add_prompt(passes[mode], prompt, args.max_new_tokens)
                else:
                    stub = stubs.get(mode, stubs["specd"])
                    specd_mode = SSD if mode in traced_addresses else mode
                    bench.add_specd_prompt(passes[mode], stub, prompt, specd_mode, args.max_new_tokens,
                                           args.num_speculative_tokens)
        for mode, result in passes.items():
            runs[mode].append(result)
            print(f"  pass {repeat + 1}/{args.repeats} {mode:<22} {result.tokens_per_s:7.1f} tok/s",
                  file=sys.stderr, flush=True)
    return runs, verify_times, target_cpus


def run_concurrency(args, levels: list[int], modes: list[str], prompts: list[str], address: str) -> dict:
    """The service modes at each --concurrency level, on the stack at `address`."""
    from benchmarks import bench_concurrency

    service_modes = [m for m in modes if m in (OFF, SD, SSD)]
    if not levels or not service_modes:
        return {}
    print(f"specd bench: {', '.join(service_modes)} at {', '.join(map(str, levels))} concurrent streams ...",
          file=sys.stderr, flush=True)
    stub = _stub(address, args if args.address else None)
    return bench_concurrency.run_levels(stub, levels, service_modes, prompts, args.max_new_tokens,
                                        args.num_speculative_tokens,
                                        log=lambda line: print(line, file=sys.stderr, flush=True))


def build_summary(args, runs: dict, traced_addresses: dict, skipped: dict[str, str], verify_times: list[float],
              target_cpus, num_prompts: int, address: str) -> dict:
    """The JSON's content; its keys are the same whether or not a mode or figure was skipped
    (a skipped mode's figures are null and its `skipped` says why)."""
    from benchmarks import bench

    summary = {"modes": bench.summarize({m: r for m, r in runs.items() if m not in traced_addresses})}
    summary["modes"].update({mode: bench.skipped_mode(reason) for mode, reason in skipped.items()})
    if traced_addresses:
        summary["tracing"] = _tracing_overhead(bench.summarize(runs))
    verify_ms = statistics.median(verify_times) if verify_times else None
    sd = summary["modes"].get(SD)
    sd_tokens_per_round = sd["tokens_per_round"] if sd else None
    limit = sd_tokens_per_round / (verify_ms / 1000.0) if sd_tokens_per_round and verify_ms else None
    target, draft = (args.target, args.draft) if not args.address else _served_models(address, args)
    summary.update(
        sd_tokens_per_round=sd_tokens_per_round,
        verify_ms=verify_ms,
        ssd_limit_tokens_per_s=limit,
        identical_outputs=_identical(runs),
        settings={
            "target": target, "draft": draft, "address": args.address, "prompts": num_prompts,
            "max_new_tokens": args.max_new_tokens, "num_speculative_tokens": args.num_speculative_tokens,
            "repeats": args.repeats, "threads_per_worker": args.threads, "temperature": 0.0,
            "device": args.device, "dtype": args.dtype,
            "target_cpus": format_cpu_list(target_cpus) if target_cpus else "",
        },
    )
    return summary


def report(summary: dict, args, verify_samples: int, target_cpus) -> None:
    from benchmarks import bench

    print(bench.format_table(summary))
    verify_ms, limit = summary["verify_ms"], summary["ssd_limit_tokens_per_s"]
    if verify_ms is not None:
        where = f"on {describe_cpus(target_cpus)} as the stack's target, " if target_cpus else f"on {args.device}, "
        print(f"verify forward (K+1={args.num_speculative_tokens + 1} tokens, in-process, {where}prompt + "
              f"{args.max_new_tokens // 2} tokens of context, median of {verify_samples} over the passes): {verify_ms:.2f} ms")
    else:
        print("verify forward: not timed (it runs the target in this process; --address benchmarks that stack only)")
    if limit:
        sd_tokens_per_round = summary["sd_tokens_per_round"]
        print(f"ssd limit = sd tokens/round {sd_tokens_per_round:.2f} / verify {verify_ms:.2f} ms = {limit:.1f} tok/s")
        if SSD in summary["modes"]:
            print(f"ssd reached {summary['modes'][SSD]['tokens_per_s'] / limit:.0%} of its limit")
    per_round = [f"{mode} {m['ms_per_round']:.2f} ms (verify forward {m['verify_ms_per_round']:.2f} ms)"
                 for mode, m in summary["modes"].items() if m.get("ms_per_round")]
    if per_round:
        print("per round in the stack, prefill included: " + ", ".join(per_round)
              + (" (ssd's verify forwards include its round 0's, which is the prompt's prefill)" if SSD in summary["modes"] else ""))
    if "tracing" in summary:
        t = summary["tracing"]
        print(f"tracing (ssd tok/s): disabled {t['disabled_tokens_per_s']:.1f}, no exporter "
              f"{t['default_tokens_per_s']:.1f}, exporting every span {t['exported_tokens_per_s']:.1f} "
              f"(cost of exporting: {t['exported_cost']:+.1%})")
    print("greedy outputs identical across specd modes: " + ("yes" if summary["identical_outputs"] else "NO"))
    if summary.get("concurrency"):
        from benchmarks import bench_concurrency

        print("concurrent client streams (tok/s: all streams together):")
        print(bench_concurrency.format_table(summary["concurrency"]))


def _default_k(address: str, args: argparse.Namespace) -> int:
    """The K the coordinator at `address` drafts when a request does not say (its ModelInfo)."""
    from specd.v1 import coordinator_pb2

    info = _stub(address, args if args.address else None).ModelInfo(coordinator_pb2.ModelInfoRequest(), timeout=60)
    return info.default_num_speculative_tokens


def _served_models(address: str, connection: argparse.Namespace) -> tuple[str, str]:
    """The target and draft the stack at `address` serves, as its ModelInfo names them."""
    from specd.v1 import coordinator_pb2

    info = _stub(address, connection).ModelInfo(coordinator_pb2.ModelInfoRequest(), timeout=30)
    return info.target_model, info.draft_model


def _stub(address: str, connection: argparse.Namespace | None):
    import grpc

    from specd.v1 import coordinator_pb2_grpc

    channel = connect.open_channel(address, connection) if connection else grpc.insecure_channel(address)
    return coordinator_pb2_grpc.CoordinatorStub(channel)


def _tracing_overhead(modes: dict) -> dict:
    """ssd tokens/s with the SDK disabled, with the default set-up, and exporting every span."""
    disabled = modes["ssd_tracing_disabled"]["tokens_per_s"]
    exported = modes["ssd_tracing_exported"]["tokens_per_s"]
    return {
        "disabled_tokens_per_s": disabled,
        "default_tokens_per_s": modes[SSD]["tokens_per_s"],
        "exported_tokens_per_s": exported,
        "exported_cost": 1.0 - exported / disabled if disabled else None,
    }


def _identical(runs: dict[str, list]) -> bool:
    outputs = [r.outputs for mode, mode_runs in runs.items() if mode in (OFF, SD, SSD) for r in mode_runs]
    return all(o == outputs[0] for o in outputs)
