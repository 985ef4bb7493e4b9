"""CPU affinity for services that share a machine's few cores.

On a small host the target's forward is the critical path of every round, while the draft's
trees and the coordinator's calls are built to run beside it. Left to the OS, all of them
share every core and the target's model thread is preempted and moved between cores; pinned to
a core of its own, its verify forward ran faster in the stack (docs/ssd.md, "CPU pinning").
"""

from __future__ import annotations

import os

from specd.core.config import ConfigError


def parse_cpu_list(text: str) -> frozenset[int]:
    """`0`, `0,2`, `0-3,6`: the CPUs named (the kernel's cpu-list format); empty: none."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        first, dash, last = part.partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise ConfigError(f"--cpus {text!r}: {part!r} is not a CPU number or range like 0-3") from None
        if low < 0 or high < low:
            raise ConfigError(f"--cpus {text!r}: {part!r} is not a CPU range")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpu_list(cpus) -> str:
    """The inverse of parse_cpu_list, ranges collapsed: {0, 1, 2, 5} -> '0-2,5'."""
    parts, ordered = [], sorted(cpus)
    start = previous = None
    for cpu in ordered + [None]:
        if start is not None and cpu == previous + 1:
            previous = cpu
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = cpu
    return ",".join(parts)


def available_cpus() -> frozenset[int]:
    """The CPUs this process may run on; empty where the OS offers no affinity (not Linux)."""
    if not hasattr(os, "sched_getaffinity"):
        return frozenset()
    return frozenset(os.sched_getaffinity(0))


def check_cpus(text: str) -> None:
    """A `--cpus` setting that names CPUs this process may run on; ConfigError otherwise."""
    cpus = parse_cpu_list(text)
    if not text.strip():
        return
    if not cpus:
        raise ConfigError(f"--cpus {text!r} names no CPU")
    if not available_cpus():
        raise ConfigError("--cpus needs an OS with CPU affinity (Linux)")
    unavailable = cpus - available_cpus()
    if unavailable:
        raise ConfigError(f"--cpus {text!r}: CPUs {format_cpu_list(unavailable)} are not available here")


def pin_process(text: str) -> None:
    """Run every thread of this process, and those it starts later, on the CPUs `text` names
    (nothing when empty). Linux keeps an affinity per thread and a new thread inherits its
    creator's, so each thread there now is set, the calling one included."""
    cpus = parse_cpu_list(text)
    if not cpus:
        return
    for thread_id in sorted(int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(thread_id, cpus)
        except ProcessLookupError:  # it ended meanwhile
            pass


def local_layout(available, target_cpus: int) -> dict[str, frozenset[int]]:
    """How `specd up` places its services on this machine's CPUs: the target on the first
    `target_cpus` of them (its threads times its ranks), the draft and the coordinator on the
    rest; {} (no pinning) when no CPU would be left beside the target."""
    ordered = sorted(available)
    if target_cpus < 1 or len(ordered) <= target_cpus:
        return {}
    rest = frozenset(ordered[target_cpus:])
    return {"target": frozenset(ordered[:target_cpus]), "draft": rest, "coordinator": rest}


def stack_layout(threads: int, target_ranks: int = 1) -> dict[str, frozenset[int]]:
    """`specd up`'s layout here: local_layout over the CPUs this process may use, the target
    taking its threads times its ranks ({} with threads 0, torch's own count)."""
    return local_layout(available_cpus(), threads * target_ranks)


def cpus_flags(layout: dict[str, frozenset[int]]) -> dict[str, list[str]]:
    """Each service's `--cpus` flag for a layout: {"target": ["--cpus", "0"], ...}."""
    return {name: ["--cpus", format_cpu_list(cpus)] for name, cpus in layout.items()}


def describe_cpus(cpus) -> str:
    """`CPU 0`, `CPUs 1-3`: for messages."""
    return ("CPU " if len(cpus) == 1 else "CPUs ") + format_cpu_list(cpus)
