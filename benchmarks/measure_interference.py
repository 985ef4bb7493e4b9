"""How much a draft working beside the target slows the target's verify forward.

In ssd the draft builds the next round's tree while the target verifies; on a CPU they share
caches and memory bandwidth. This times the target's forward over K+1 tokens (one torch
thread, after a prompt-sized context) in blocks that alternate between an idle machine and
one where another process runs the draft's tree-step forwards (B tokens on its own context)
in a loop, so that the machine's drift hits both alike. Both models compute as the workers
serve them on one thread (prepacked weights, specd's few-row kernel, the draft's bfloat16
copies), each pinned to a CPU of its own as `specd up` pins them (--target-cpu, --draft-cpu;
-1 leaves one unpinned). K and B default to the coordinator's defaults.

    python benchmarks/measure_interference.py                       # the default pair
    python benchmarks/measure_interference.py --blocks 10 --branches 16
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.profiles import CPU  # noqa: E402
from specd.engine.default_pair import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402


def _pin(cpu: int, allowed: set[int]) -> None:
    """Run this process on `cpu` (a worker's CPU under `specd up`) if it is among the CPUs this
    tool was started on. `allowed` is that set, taken before the timing process pinned itself:
    the draft's process inherits the timing process's affinity, and checking `cpu` against that
    would leave the draft on the target's CPU, timing two processes sharing one core."""
    if cpu >= 0 and cpu in allowed:
        os.sched_setaffinity(0, {cpu})


def _where() -> str:
    """The CPUs this process may run on, for the report."""
    return ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))


def _load(path: str, halved: bool):
    """The model as a worker serves it on one thread: prepacked, with the few-row kernel (and,
    for a draft, `halved`: its bfloat16 copies), its query heads attending in groups."""
    import torch

    from specd.engine.backends import FastPathOptions
    from specd.engine.backends.cpu import CpuBackend
    from specd.engine.loading import load_causal_lm

    torch.set_num_threads(1)
    model = load_causal_lm(path).model
    CpuBackend("cpu").prepare(model, FastPathOptions(halved=halved))
    return model


def _draft_loop(path: str, branches: int, context: int, cpu: int, allowed: set[int], stop, report) -> None:
    """Draft forwards of `branches` tokens on a `context`-token cache until `stop` is set;
    the CPUs it ran on go to `report` (a queue)."""
    import torch

    from specd.engine.kv_cache import GrowingKVCache

    _pin(cpu, allowed)
    report.put(_where())
    model = _load(path, halved=True)
    with torch.inference_mode():
        cache = GrowingKVCache()
        model(torch.randint(1, model.config.vocab_size, (1, context)), past_key_values=cache)  # [1, context]
        step = torch.randint(1, model.config.vocab_size, (1, branches))  # [1, B]
        while not stop.is_set():
            model(step, past_key_values=cache)
            cache.crop(-branches)


def _time_forwards(model, cache, block, count: int) -> list[float]:
    import torch

    times = []
    with torch.inference_mode():
        for _ in range(count):
            started = time.perf_counter()
            model(block, past_key_values=cache, logits_to_keep=block.shape[1])
            times.append((time.perf_counter() - started) * 1000.0)
            cache.crop(-block.shape[1])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--k", type=int, default=CPU.num_speculative_tokens)
    parser.add_argument("--context", type=int, default=100, help="tokens cached before each timed forward")
    parser.add_argument("--branches", type=int, default=CPU.ssd_budget, help="tokens per draft forward (a tree step)")
    parser.add_argument("--target-cpu", type=int, default=0, help="CPU of the timed target (-1: not pinned)")
    parser.add_argument("--draft-cpu", type=int, default=1, help="CPU of the draft beside it (-1: not pinned)")
    parser.add_argument("--blocks", type=int, default=6, help="blocks of each condition, alternating")
    parser.add_argument("--forwards", type=int, default=15, help="timed forwards per block")
    args = parser.parse_args()

    import torch

    from specd.engine.kv_cache import GrowingKVCache

    allowed = os.sched_getaffinity(0)
    _pin(args.target_cpu, allowed)
    model = _load(args.target, halved=False)
    vocab = model.config.vocab_size
    cache = GrowingKVCache()
    with torch.inference_mode():
        model(torch.randint(1, vocab, (1, args.context)), past_key_values=cache)  # [1, context]
    block = torch.randint(1, vocab, (1, args.k + 1))  # [1, K+1]
    _time_forwards(model, cache, block, 3)  # warm-up
    context = multiprocessing.get_context("spawn")
    report = context.Queue()
    times: dict[str, list[float]] = {"alone": [], "beside the draft": []}
    draft_cpus = set()
    for index in range(2 * args.blocks):
        busy = index % 2 == 1
        stop = context.Event()
        worker = None
        if busy:
            worker = context.Process(
                target=_draft_loop, args=(args.draft, args.branches, args.context, args.draft_cpu, allowed, stop, report)
            )
            worker.start()
            draft_cpus.add(report.get(timeout=60))
            time.sleep(3.0)  # the draft loads and reaches its loop
        times["beside the draft" if busy else "alone"] += _time_forwards(model, cache, block, args.forwards)
        if worker is not None:
            stop.set()
            worker.join()
    alone = statistics.median(times["alone"])
    print(f"target on CPUs {_where()}, draft on CPUs {' / '.join(sorted(draft_cpus))}")
    for name, values in times.items():
        print(f"{name:<17} median {statistics.median(values):6.2f} ms  (p25 {statistics.quantiles(values, n=4)[0]:.2f}, "
              f"p75 {statistics.quantiles(values, n=4)[2]:.2f}, {len(values)} forwards)")
    print(f"slowdown beside the draft: {statistics.median(times['beside the draft']) / alone - 1:+.1%}")


if __name__ == "__main__":
    main()
