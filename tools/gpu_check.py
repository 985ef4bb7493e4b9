"""specd's GPU check: does the stack start, stay exact and cost what the GPU allows (tools/gpu_check.sh).

One run, within minutes on one GPU and no network: the device-placement tests for real on CUDA;
`specd up --device cuda --dtype float32` on the tests' tiny pair, its greedy output in off, sd and
ssd against the target alone (benchmarks/check_exactness.py); a synthetic pair of a real model's
shape (benchmarks/synthetic_pair.py: a Llama-3.1-8B-shaped target in bfloat16 whose later layers
add small residuals, and a draft of its first layers) through `specd bench` on the GPU; and its
one-token step and verify of K + 1 tokens timed against the weight-bytes floor. Everything it
measured goes into one JSON (--out).

    python tools/gpu_check.py --out gpu-check            # on the GPU machine
    python tools/gpu_check.py --dry-run                  # here: every file, flag and model it uses

--dry-run checks on a CPU that the files exist, that the commands take the flags it passes, and
that the synthetic pair builds, saves and loads (at a tiny shape).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FILES = ("tests/engine/test_device_placement.py", "tests/tiny_models.py", "benchmarks/check_exactness.py",
         "benchmarks/synthetic_pair.py", "benchmarks/bench.py", "models/smollm2-draft/bench_prompts.json")
# Each command and the flags this check passes it.
FLAGS = {
    ("specd", "up"): ("--target", "--draft", "--device", "--dtype", "--port", "--metrics-port", "--log-dir"),
    ("specd", "bench"): ("--target", "--draft", "--device", "--dtype", "--modes", "--num-prompts", "--max-new-tokens", "--json"),
    ("benchmarks/check_exactness.py",): ("--address", "--prompts-file", "--reference", "--modes", "--max-new-tokens", "--json"),
    ("benchmarks/synthetic_pair.py",): ("--shape", "--draft-layers", "--residual-scale", "--device", "--dtype"),
}
HBM_BYTES_PER_S = 4.3e12  # what a device-to-device copy moved on the H200 (bytes read + written)
K = 4


def python(*args: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python ARGS` from the checkout (a script, or -m MODULE), its output captured."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


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


def device_placement() -> dict:
    """The device-placement tests, run for real on the GPU."""
    run = python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "device_placement", "tests/engine/test_device_placement.py",
                 timeout=300, env={"SPECD_PLACEMENT_DEVICE": "cuda"})
    return {"passed": run.returncode == 0, "summary": run.stdout.strip().splitlines()[-1:]}


def start_stack(target: str, draft: str, dtype: str, log_dir: pathlib.Path) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "specd", "up", "--target", target, "--draft", draft, "--device", "cuda", "--dtype", dtype,
         "--port", "0", "--metrics-port", "-1", "--log-dir", str(log_dir)],
        cwd=ROOT, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    for line in process.stdout:
        if line.startswith("coordinator listening on "):
            return process, line.split()[-1]
    raise RuntimeError(f"specd up exited with code {process.wait()}; logs in {log_dir}")


def tiny_exactness(work: pathlib.Path) -> dict:
    """The tests' tiny pair on the GPU in float32: greedy off, sd and ssd against the target alone."""
    from tests.tiny_models import save_pair

    target, draft = save_pair(work / "tiny")
    prompts = work / "tiny_prompts.json"
    prompts.write_text(json.dumps(["def add(a, b):\n", "for i in range(10):\n", "The quick brown fox", "import os\n"]))
    process, address = start_stack(target, draft, "float32", work / "tiny-logs")
    try:
        run = python("benchmarks/check_exactness.py", "--address", address, "--prompts-file", str(prompts), "--reference", target,
                     "--max-new-tokens", "48", "--json", str(work / "exactness.json"), timeout=300)
    finally:
        process.terminate()
        process.wait(timeout=60)
    report = json.loads((work / "exactness.json").read_text()) if (work / "exactness.json").is_file() else {}
    return {"identical_or_near_tie": run.returncode == 0, "report": report, "tail": run.stdout.strip().splitlines()[-6:]}


def synthetic_bench(work: pathlib.Path, shape: str, residual_scale: float, prompts: int, max_new_tokens: int) -> dict:
    """The synthetic pair through `specd bench` on the GPU in bfloat16."""
    made = python("benchmarks/synthetic_pair.py", str(work / "synthetic"), "--shape", shape, "--residual-scale", str(residual_scale),
                  "--device", "cuda", "--dtype", "bfloat16", timeout=600)
    if made.returncode != 0:
        return {"built": False, "stderr": made.stderr[-2000:]}
    out = work / "bench.json"
    run = python("-m", "specd", "bench", "--target", str(work / "synthetic" / "target"), "--draft", str(work / "synthetic" / "draft"),
                 "--device", "cuda", "--dtype", "bfloat16", "--modes", "off,sd,ssd", "--num-prompts", str(prompts),
                 "--max-new-tokens", str(max_new_tokens), "--json", str(out), timeout=900)
    return {"built": True, "bench": json.loads(out.read_text()) if out.is_file() else None, "stderr": run.stderr[-2000:]}


def step_timing(target_folder: pathlib.Path, context: int = 512, repeats: int = 20) -> dict:
    """The target's one-token step and verify of K + 1 tokens on the GPU, against reading its weights once."""
    import torch

    from specd.engine.forward import forward_logits
    from specd.engine.kv_cache import GrowingKVCache
    from specd.engine.loading import load_causal_lm

    model = load_causal_lm(str(target_folder), dtype="bfloat16", device="cuda").model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    times = {}
    for tokens in (1, K + 1):
        samples = []
        for _ in range(repeats):
            cache = GrowingKVCache()
            forward_logits(model, cache, list(range(1, context + 1)), 1)
            samples.append(forward_logits(model, cache, list(range(1, tokens + 1)), tokens)[1])
        times[tokens] = sorted(samples)[len(samples) // 2]
    floor_ms = weight_bytes / HBM_BYTES_PER_S * 1000.0
    return {"weight_bytes": weight_bytes, "floor_ms": floor_ms, "step_ms": times[1], "verify_ms": times[K + 1],
            "step_over_floor": times[1] / floor_ms, "verify_over_step": times[K + 1] / times[1], "torch": torch.__version__}


def dry_run() -> int:
    """On a CPU: every file and flag exists, and the synthetic pair builds, saves and loads at a tiny shape."""
    problems = check_files_and_flags()
    with tempfile.TemporaryDirectory() as work:
        made = python("benchmarks/synthetic_pair.py", work, "--shape", "tiny", "--device", "cpu", "--dtype", "float32", timeout=300)
        if made.returncode != 0:
            problems.append(f"benchmarks/synthetic_pair.py --shape tiny failed: {made.stderr[-1000:]}")
        else:
            from specd.engine.loading import load_causal_lm

            for name in ("target", "draft"):
                load_causal_lm(str(pathlib.Path(work) / name), device="cpu")
    for problem in problems:
        print(f"gpu_check --dry-run: {problem}", file=sys.stderr)
    print("gpu_check --dry-run: " + ("ready" if not problems else f"{len(problems)} problems"))
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="check, on a CPU, what a run needs (default: run on the GPU)")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "gpu-check", help="folder for the JSON and the work (default: %(default)s)")
    parser.add_argument("--shape", default="llama-3.1-8b", help="the synthetic target's shape (default: %(default)s)")
    parser.add_argument("--residual-scale", type=float, default=0.1, help="the synthetic pair's closeness (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=4, help="bench prompts on the synthetic pair (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per bench prompt (default: %(default)s)")
    args = parser.parse_args()
    if args.dry_run:
        return dry_run()
    args.out.mkdir(parents=True, exist_ok=True)
    from benchmarks.bench import run_stamp

    report: dict = {"run": run_stamp(), "missing": check_files_and_flags()}
    steps = (("device_placement", device_placement), ("tiny_exactness", lambda: tiny_exactness(args.out)),
             ("synthetic_bench", lambda: synthetic_bench(args.out, args.shape, args.residual_scale, args.prompts, args.max_new_tokens)),
             ("step_timing", lambda: step_timing(args.out / "synthetic" / "target")))
    for name, step in steps:
        started = time.perf_counter()
        try:
            report[name] = step()
        except Exception as exc:  # noqa: BLE001 - the next steps still run; the JSON says what failed
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        report[name]["seconds"] = round(time.perf_counter() - started, 1)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        print(f"gpu_check: {name} done in {report[name]['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
