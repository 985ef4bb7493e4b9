"""Time a batch of greedy verifies' decisions two ways, side by side: each verify decided alone
(its ratio test's tensors, then its own read-back) and the batch decided together
(target_service/verify_decision.py: the argmax rows read back at once, matched on the host).

Random logits of the vocabulary's width on --device; verifies of K + 1 rows, half their draft
matching; the arms alternate, and the median of --repeats per batch size is printed with the
ratio together / alone. On a GPU each read-back is a wait for the device.

    python benchmarks/measure_decisions.py
    python benchmarks/measure_decisions.py --device cuda --vocab 128256 --batches 1,8,32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specd.core.sampling import SamplingSettings  # noqa: E402
from target_service.calls import VerifyCall  # noqa: E402
from target_service.verify_decision import Verified, decide, decide_all  # noqa: E402


def verifies(batch: int, k: int, vocab: int, device: str) -> list[Verified]:
    logits = torch.randn(batch * (k + 1), vocab, device=device).split(k + 1)  # [K+1, V] each, as a packed forward's
    made = []
    for rows in logits:
        best = rows.argmax(-1).tolist()
        draft = best[: k // 2] + [(t + 1) % vocab for t in best[k // 2 : k]]
        made.append(Verified(VerifyCall("s", 0, [1], draft, [], SamplingSettings(), False), rows, [], 10, 10 + k))
    return made


def time_both(batch: int, k: int, vocab: int, device: str, repeats: int) -> tuple[float, float]:
    """The median us of deciding `batch` greedy verifies each alone, and together (arms alternating)."""
    made = verifies(batch, k, vocab, device)
    arms = {"alone": lambda: [decide(v, 0.0) for v in made], "together": lambda: decide_all(made, 0.0)}
    assert arms["alone"]() == arms["together"](), "the two ways decided differently"
    times: dict[str, list[float]] = {name: [] for name in arms}
    for n in range(repeats):
        for name in list(arms)[n % 2 :] + list(arms)[: n % 2]:
            started = time.perf_counter()
            arms[name]()  # both end in a read-back: on a GPU, a wait for the device
            times[name].append((time.perf_counter() - started) * 1e6)
    return statistics.median(times["alone"]), statistics.median(times["together"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=49152, help="the default target's vocabulary (default: %(default)s)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a worker's default: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for batch in map(int, args.batches.split(",")):
        alone, together = time_both(batch, args.k, args.vocab, args.device, args.repeats)
        print(f"batch {batch:3d}: each alone {alone:8.0f} us, together {together:8.0f} us, together / alone {together / alone:.2f}")


if __name__ == "__main__":
    main()
