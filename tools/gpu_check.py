"""specd's GPU check: does the stack start, stay exact and cost what the GPU allows (tools/gpu_check.sh).

One run, within minutes on one GPU and no network: the device-placement tests for real on CUDA;
`specd up --device cuda --dtype float32` on the tests' tiny pair, its greedy output in off, sd and
ssd against the target alone (benchmarks/check_exactness.py); a synthetic pair of a real model's
shape (benchmarks/synthetic_pair.py: a Llama-3.1-8B-shaped target in bfloat16 whose later layers
add small residuals, and a draft of its first layers) through `specd bench` on the GPU; and its
one-token step and verify of K + 1 tokens timed against the floor of reading its weights once (as a
worker serves one session, and as a plain forward), and a packed verify of several sessions with
attention per session against one call over the KV pool and its CUDA graph.
Everything it measured goes into one JSON, OUT/gpu_check.json; the models and logs it makes stay
in a temporary folder (--work) it removes at the end. The whole run keeps to --budget-s: each step
gets its share of what is left, and a step past it is stopped with everything it started.

    python tools/gpu_check.py --out gpu-check            # on the GPU machine
    python tools/gpu_check.py --dry-run                  # here: every file, flag and model it uses

--dry-run checks on a CPU that the files exist, that the commands take the flags it passes, and
that the synthetic pair builds, saves, loads and writes more than an end of text (at a tiny shape).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FILES = ("tests/engine/test_device_placement.py", "tests/tiny_models.py", "benchmarks/check_exactness.py",
         "benchmarks/synthetic_pair.py", "benchmarks/bench.py", "models/smollm2-draft/bench_prompts.json")
# Each command and the flags this check passes it.
FLAGS = {
    ("specd", "up"): ("--target", "--draft", "--device", "--dtype", "--port", "--metrics-port", "--http-port", "--log-dir"),
    ("specd", "bench"): ("--target", "--draft", "--device", "--dtype", "--modes", "--prompts", "--num-prompts",
                         "--max-new-tokens", "--json"),
    ("benchmarks/check_exactness.py",): ("--address", "--prompts-file", "--reference", "--modes", "--max-new-tokens", "--json"),
    ("benchmarks/synthetic_pair.py",): ("--shape", "--draft-layers", "--residual-scale", "--device", "--dtype", "--prompts"),
}
HBM_BYTES_PER_S = 4.3e12  # what a device-to-device copy moved on the H200 (bytes read + written)
K = 4
# Each step's share of the time left when it starts (the last takes what is left).
SHARES = {"device_placement": 0.15, "tiny_exactness": 0.2, "synthetic_bench": 0.75, "step_timing": 1.0}


def python(*args: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python ARGS` from the checkout (a script, or -m MODULE), its output captured; past
    `timeout` it is stopped with every process it started (subprocess.TimeoutExpired)."""
    process = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               stdin=subprocess.DEVNULL, start_new_session=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    try:
        stdout, stderr = process.communicate(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        stop_group(process)
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def stop_group(process: subprocess.Popen) -> None:
    """Stop `process` and what it started (its own session): SIGTERM, then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.communicate(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue


def argv_of(command: tuple[str, ...]) -> list[str]:
    """A FLAGS command as python's arguments: `specd X` is `-m specd X`."""
    return ["-m", *command] if command[0] == "specd" else list(command)


def check_files_and_flags() -> list[str]:
    """What a run needs that is missing: files, or flags a command does not take."""
    missing = [f"missing file {name}" for name in FILES if not (ROOT / name).is_file()]
    for command, flags in FLAGS.items():
        helped = python(*argv_of(command), "--help", timeout=120)
        missing += [f"{' '.join(command)} has no {flag}" for flag in flags if flag not in helped.stdout]
    return missing


def device_placement(work: pathlib.Path, timeout: float) -> dict:
    """The device-placement tests, run for real on the GPU."""
    run = python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "device_placement", "tests/engine/test_device_placement.py",
                 timeout=timeout, env={"SPECD_PLACEMENT_DEVICE": "cuda"})
    return {"passed": run.returncode == 0, "summary": run.stdout.strip().splitlines()[-1:],
            "failures": run.stdout[-3000:] if run.returncode else ""}


def start_stack(target: str, draft: str, dtype: str, log_dir: pathlib.Path, timeout: float) -> tuple[subprocess.Popen, str]:
    """`specd up` on the GPU in a session of its own; its address once it serves."""
    process = subprocess.Popen(
        [sys.executable, "-m", "specd", "up", "--target", target, "--draft", draft, "--device", "cuda", "--dtype", dtype,
         "--port", "0", "--metrics-port", "-1", "--http-port", "-1", "--log-dir", str(log_dir)],
        cwd=ROOT, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    timer = threading.Timer(max(timeout, 1.0), kill_group, (process,))  # a stack that never serves
    timer.start()
    try:
        for line in process.stdout:
            if line.startswith("coordinator listening on "):
                return process, line.split()[-1]
    finally:
        timer.cancel()
    raise RuntimeError(f"specd up exited with code {process.wait()}: {log_tails(log_dir)}")


def kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def log_tails(log_dir: pathlib.Path, lines: int = 15) -> dict:
    """The last lines of each service's log: what the JSON keeps of a stack that failed."""
    return {log.name: log.read_text(errors="replace").splitlines()[-lines:] for log in sorted(log_dir.glob("*.log"))}


def tiny_exactness(work: pathlib.Path, timeout: float) -> dict:
    """The tests' tiny pair on the GPU in float32: greedy off, sd and ssd against the target alone."""
    from tests.tiny_models import save_pair

    deadline = time.monotonic() + timeout
    target, draft = save_pair(work / "tiny")
    prompts = work / "tiny_prompts.json"
    prompts.write_text(json.dumps(["def add(a, b):\n", "for i in range(10):\n", "The quick brown fox", "import os\n"]))
    process, address = start_stack(target, draft, "float32", work / "tiny-logs", deadline - time.monotonic())
    try:
        run = python("benchmarks/check_exactness.py", "--address", address, "--prompts-file", str(prompts), "--reference", target,
                     "--max-new-tokens", "48", "--json", str(work / "exactness.json"), timeout=deadline - time.monotonic() - 30)
    finally:
        stop_group(process)
    report = json.loads((work / "exactness.json").read_text()) if (work / "exactness.json").is_file() else {}
    return {"identical_or_near_tie": run.returncode == 0, "report": report, "tail": run.stdout.strip().splitlines()[-6:],
            "stderr": run.stderr[-2000:] if run.returncode else ""}


def synthetic_bench(work: pathlib.Path, timeout: float, shape: str, residual_scale: float, prompts: int, max_new_tokens: int) -> dict:
    """The synthetic pair through `specd bench` on the GPU in bfloat16: off, sd and ssd on word
    prompts, and the verify forward timed in-process (no HF assisted generation: two more copies
    of the target would be load time the check has no use for)."""
    deadline = time.monotonic() + timeout
    pair = work / "synthetic"
    made = python("benchmarks/synthetic_pair.py", str(pair), "--shape", shape, "--residual-scale", str(residual_scale),
                  "--device", "cuda", "--dtype", "bfloat16", "--prompts", str(prompts), timeout=deadline - time.monotonic())
    if made.returncode != 0:
        return {"built": False, "stderr": made.stderr[-2000:]}
    out = work / "bench.json"
    run = python("-m", "specd", "bench", "--target", str(pair / "target"), "--draft", str(pair / "draft"),
                 "--device", "cuda", "--dtype", "bfloat16", "--modes", "off,sd,ssd", "--prompts", str(pair / "prompts.json"),
                 "--num-prompts", str(prompts), "--max-new-tokens", str(max_new_tokens), "--json", str(out),
                 timeout=deadline - time.monotonic())
    return {"built": True, "bench": json.loads(out.read_text()) if out.is_file() else None,
            "stdout": run.stdout[-3000:], "stderr": run.stderr[-2000:] if run.returncode else ""}


def step_timing(work: pathlib.Path, timeout: float, context: int = 512, repeats: int = 20) -> dict:
    """The synthetic target's one-token step and verify of K + 1 tokens on the GPU, against reading
    its weights once (every parameter but the input embedding, of which a step reads a row a
    token): `step_ms` and `verify_ms` (and the ratios) as a worker serves one session
    (`served_path`: over the KV pool, a CUDA graph where kept; without the pool, the plain
    forward), `eager_step_ms` and `eager_verify_ms` as a plain transformers forward; and a packed
    verify of several sessions (served_timing)."""
    import torch

    from specd.engine.forward import forward_logits
    from specd.engine.kv_cache import GrowingKVCache
    from specd.engine.loading import load_causal_lm

    model = load_causal_lm(str(work / "synthetic" / "target"), dtype="bfloat16", device="cuda").model
    embedding = model.get_input_embeddings().weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - embedding.numel() * embedding.element_size()
    eager = {}
    for tokens in (1, K + 1):
        samples = []
        for _ in range(repeats):
            cache = GrowingKVCache()
            forward_logits(model, cache, list(range(2, context + 2)), 1)
            samples.append(forward_logits(model, cache, list(range(2, tokens + 2)), tokens)[1])
        eager[tokens] = sorted(samples)[len(samples) // 2]
    floor_ms = weight_bytes / HBM_BYTES_PER_S * 1000.0
    report = {"weight_bytes_read": weight_bytes, "floor_ms": floor_ms, "eager_step_ms": eager[1], "eager_verify_ms": eager[K + 1],
              "torch": torch.__version__, "served_path": "eager", "step_ms": eager[1], "verify_ms": eager[K + 1]}
    for name, measure in (("served", lambda: served_timing(model, batch=8, context=context, repeats=repeats)),
                          ("greedy_decisions", lambda: decision_timing(model.config.vocab_size, "cuda", repeats))):
        try:
            report.update(measure())
        except Exception as exc:  # noqa: BLE001 - the step's other figures stand; the JSON says what failed
            report[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
    report["step_over_floor"] = report["step_ms"] / floor_ms
    report["verify_over_step"] = report["verify_ms"] / report["step_ms"]
    return report


def decision_timing(vocab: int, device: str, repeats: int) -> dict:
    """greedy_decisions_us: deciding a batch's greedy verifies each alone and together
    (benchmarks/measure_decisions.py)."""
    from benchmarks.measure_decisions import time_both

    timed = {}
    for batch in (1, 8):
        alone, together = time_both(batch, K, vocab, device, repeats)
        timed[f"batch_{batch}"] = {"alone": alone, "together": together}
    return {"greedy_decisions_us": timed}


def served_timing(model, batch: int, context: int, repeats: int) -> dict:
    """Forwards as a worker with a KV pool runs them, on sessions of `context` tokens, each arm's
    median ms after a warm-up forward (which compiles its kernels and captures its graph): one
    session's one-token step and verify of K + 1 (`lone`; `step_ms` and `verify_ms` on the path a
    worker takes, `served_path`), and a verify of K + 1 for `batch` sessions in one packed forward
    (`packed_verify`), with attention per session, over the pool in one call per layer, and (on a
    GPU) replayed as a CUDA graph."""
    from specd.engine.forward import forward_logits
    from specd.engine.kv_pool import BLOCK_TOKENS, KVPool, PooledKVCache
    from specd.engine.packed_forward import enable_packing

    pool = KVPool.for_model(model, (batch + 1) * (context + 2 * BLOCK_TOKENS))
    started = time.monotonic()
    packer = enable_packing(model, pool, graphs=model.device.type == "cuda")
    probe = {"probe_s": time.monotonic() - started, "pooled_probe_agrees": bool(packer and packer.pooled)}
    if packer is None:  # a worker forwards each session alone: the plain forward (eager_step_ms)
        return {"packed_verify": {"batch": batch, "context": context, **probe}}
    caches = [PooledKVCache(pool.allocate(context + BLOCK_TOKENS)) for _ in range(batch)]
    for i, cache in enumerate(caches):
        forward_logits(model, cache, [2 + (i + t) % 50 for t in range(context)], 1)
    arms = {"per_session_ms": (False, False)}
    if packer.pooled:
        arms["pooled_ms"] = (True, False)
        if packer.over_pool.graphs:
            arms["graphed_ms"] = (True, True)
    lone = {tokens: time_arms(packer, caches[:1], tokens, arms, repeats) for tokens in (1, K + 1)}
    packed = time_arms(packer, caches, K + 1, arms, repeats)
    packed_verify = {"batch": batch, "context": context, **probe, **packed, "graphs_kept": packer.over_pool.graphs}
    served = list(arms)[-1]  # graphs where kept, else attention over the pool, as a worker prefers
    if served == "per_session_ms":  # no pool: a worker forwards a lone session plainly (eager_step_ms)
        return {"lone": lone, "packed_verify": packed_verify}
    return {"served_path": served.removesuffix("_ms"), "step_ms": lone[1][served], "verify_ms": lone[K + 1][served],
            "lone": lone, "packed_verify": packed_verify}


def time_arms(packer, caches: list, tokens: int, arms: dict, repeats: int) -> dict:
    """Each arm's median ms for a forward of `tokens` per cache, rolled back after each; an arm of
    graphs that turned off on the way (a capture failed or differed) leaves `arms`."""
    from specd.engine.packed_forward import Segment

    times = {}
    for name, (pooled, graphs) in list(arms.items()):
        packer.pooled, packer.over_pool.graphs = pooled, graphs
        samples = []
        for _ in range(repeats + 1):  # the first warms up
            _, forward_ms = packer.forward([Segment(cache, list(range(3, tokens + 3)), tokens) for cache in caches])
            samples.append(forward_ms)
            for cache in caches:
                cache.crop(-tokens)
        if graphs and not packer.over_pool.graphs:
            del arms[name]  # the worker's log says why
            continue
        times[name] = sorted(samples[1:])[repeats // 2]
    return times


def dry_run() -> int:
    """On a CPU: every file and flag exists, and the synthetic pair builds, saves, loads and
    generates words at a tiny shape."""
    problems = check_files_and_flags()
    with tempfile.TemporaryDirectory() as work:
        made = python("benchmarks/synthetic_pair.py", work, "--shape", "tiny", "--device", "cpu", "--dtype", "float32",
                      "--prompts", "2", timeout=300)
        if made.returncode != 0:
            problems.append(f"benchmarks/synthetic_pair.py --shape tiny failed: {made.stderr[-1000:]}")
        else:
            from benchmarks.synthetic_pair import greedy_smoke
            from specd.engine.loading import load_causal_lm

            load_causal_lm(str(pathlib.Path(work) / "draft"), device="cpu")
            target = load_causal_lm(str(pathlib.Path(work) / "target"), device="cpu").model
            served = served_timing(target, batch=2, context=16, repeats=1)
            decision_timing(target.config.vocab_size, "cpu", repeats=1)
            if served.get("served_path") != "pooled" or "pooled_ms" not in served["packed_verify"]:
                problems.append(f"the forwards over the KV pool did not run at the tiny shape: {served}")
            words = [t for t in greedy_smoke(str(pathlib.Path(work) / "target")) if t != 0]
            if len(words) < 2:
                problems.append(f"the tiny synthetic target wrote {len(words)} tokens before its end of text")
            if len(json.loads((pathlib.Path(work) / "prompts.json").read_text())) != 2:
                problems.append("benchmarks/synthetic_pair.py --prompts 2 did not write 2 prompts")
    if not (ROOT / "wheels").is_dir() and not os.environ.get("SPECD_WHEELS"):
        print("gpu_check --dry-run: note: no wheels/ (make gpu-wheels): the GPU machine must have every package", file=sys.stderr)
    for problem in problems:
        print(f"gpu_check --dry-run: {problem}", file=sys.stderr)
    print("gpu_check --dry-run: " + ("ready" if not problems else f"{len(problems)} problems"))
    return 1 if problems else 0


def run_steps(args: argparse.Namespace, work: pathlib.Path) -> dict:
    """Every step in turn, each within its share of the time left; the JSON rewritten after each."""
    from benchmarks.bench import run_stamp

    deadline = time.monotonic() + args.budget_s
    report: dict = {"run": run_stamp(), "budget_s": args.budget_s, "missing": check_files_and_flags()}
    steps = {
        "device_placement": lambda t: device_placement(work, t),
        "tiny_exactness": lambda t: tiny_exactness(work, t),
        "synthetic_bench": lambda t: synthetic_bench(work, t, args.shape, args.residual_scale, args.prompts, args.max_new_tokens),
        "step_timing": lambda t: step_timing(work, t),
    }
    for name, step in steps.items():
        started = time.monotonic()
        budget = SHARES[name] * (deadline - started)
        try:
            report[name] = step(budget)
        except subprocess.TimeoutExpired:
            report[name] = {"error": f"stopped after its {budget:.0f} s"}
        except Exception as exc:  # noqa: BLE001 - the next steps still run; the JSON says what failed
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        report[name]["seconds"] = round(time.monotonic() - started, 1)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        print(f"gpu_check: {name} done in {report[name]['seconds']} s", flush=True)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="check, on a CPU, what a run needs (default: run on the GPU)")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "gpu-check", help="folder for gpu_check.json (default: %(default)s)")
    parser.add_argument("--work", type=pathlib.Path, default=None,
                        help="where its temporary folder for the models and logs goes, removed at the end (default: the system's)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="the whole run's time (default: %(default)s)")
    parser.add_argument("--shape", default="llama-3.1-8b", help="the synthetic target's shape (default: %(default)s)")
    parser.add_argument("--residual-scale", type=float, default=0.1, help="the synthetic pair's closeness (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=4, help="bench prompts on the synthetic pair (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per bench prompt (default: %(default)s)")
    args = parser.parse_args()
    if args.dry_run:
        return dry_run()
    args.out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="specd-gpu-check-", dir=args.work))
    try:
        run_steps(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
