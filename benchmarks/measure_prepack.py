"""Time a model's forwards with and without prepacked linear weights, side by side.

Loads the model three times (as it comes; with specd/engine/backends/cpu_kernels/prepacked_linear.py's layers on oneDNN's
product alone; and with specd's few-row kernel taking products of 1-8 rows, as a worker serves
it on one thread; with --halved a fourth time, as the draft worker serves a draft: products of
1-8 rows on the kernel on bfloat16 copies of the weights), prefills each with the same context,
then times forwards of each length on top of it, rotating which copy goes first, and prints
the median per length and the ratio of each length to a one-token step: what
`--prepack-weights`, `--few-row-kernel` and `--few-row-bf16` buy on this CPU. With `--cpu` it
runs pinned there (the target worker's CPU under `specd up` is 0).

    python benchmarks/measure_prepack.py --cpu 0
    python benchmarks/measure_prepack.py --model models/smollm2-draft --lengths 1,9
    python benchmarks/measure_prepack.py --model models/smollm2-draft --lengths 1,2,4,8 --halved --cpu 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specd.engine.backends.cpu_kernels.prepacked_linear import PrepackedLinear, prepack_linears  # noqa: E402
from specd.engine.default_pair import DEFAULT_TARGET  # noqa: E402
from specd.engine.kv_cache import GrowingKVCache  # noqa: E402
from specd.engine.loading import load_causal_lm  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET, help="model folder or the default target's name")
    parser.add_argument("--lengths", default="1,5,9", help="tokens per forward, comma-separated (include 1: the ratios are to it)")
    parser.add_argument("--context", type=int, default=150, help="tokens cached before the timed forwards")
    parser.add_argument("--trials", type=int, default=10, help="timed forwards per length and copy")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a worker's default under specd up is 1)")
    parser.add_argument("--cpu", type=int, default=-1, help="pin to this CPU (-1: do not pin)")
    parser.add_argument("--halved", action="store_true",
                        help="a fourth copy as the draft worker serves it: 1-8 rows on the kernel on bfloat16 copies (--few-row-bf16)")
    return parser.parse_args(argv)


def time_forwards(models: dict, lengths: list[int], context: int, trials: int) -> dict[tuple[str, int], list[float]]:
    """ms of each (copy, length) forward on top of `context` cached tokens, the copies alternating."""
    vocab = next(iter(models.values())).config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), generator=generator)  # [1, context]
    times = {(name, n): [] for name in models for n in lengths}
    with torch.inference_mode():
        caches = {}
        for name, model in models.items():
            caches[name] = GrowingKVCache()
            model(input_ids=prefix, past_key_values=caches[name], use_cache=True)
        for trial in range(trials + 1):  # trial 0 warms up
            for n in lengths:
                ids = torch.randint(0, vocab, (1, n), generator=generator)  # [1, n]
                shift = trial % len(models)
                order = list(models)[shift:] + list(models)[:shift]  # each copy goes first in turn
                for name in order:
                    started = time.perf_counter()
                    models[name](input_ids=ids, past_key_values=caches[name], use_cache=True, logits_to_keep=n)
                    elapsed = (time.perf_counter() - started) * 1000.0
                    caches[name].crop(-n)
                    if trial:
                        times[(name, n)].append(elapsed)
    return times


def main() -> None:
    args = parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.cpu >= 0:
        os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(args.threads)
    plain = load_causal_lm(args.model).model
    packed = load_causal_lm(args.model).model
    if not prepack_linears(packed, few_row_kernel=False):
        sys.exit("no linear layer of this model can be prepacked on this machine")
    models = {"plain": plain, "prepacked": packed}
    kernel = load_causal_lm(args.model).model
    prepack_linears(kernel)
    if any(isinstance(m, PrepackedLinear) and m.product.kernel is not None for m in kernel.modules()):
        models["kernel"] = kernel
        if args.halved:
            halved = load_causal_lm(args.model).model
            prepack_linears(halved, halved=True)
            models["bf16"] = halved
    else:
        print("specd's few-row kernel does not run here: timing the other two")
    times = time_forwards(models, lengths, args.context, args.trials)
    print(f"{args.model}: {args.context} tokens of context, {args.threads} thread(s), median of {args.trials}")
    for name in models:
        medians = {n: statistics.median(times[(name, n)]) for n in lengths}
        cells = []
        for n in lengths:
            ratio = f" ({medians[n] / medians[1]:.2f}x)" if 1 in medians and n != 1 else ""
            cells.append(f"{n} tokens {medians[n]:.1f} ms{ratio}")
        print(f"{name:>9}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
