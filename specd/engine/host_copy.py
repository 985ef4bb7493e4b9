"""Reading a forward's few results back to the host in one wait.

On a GPU each `.item()` or `.tolist()` is a copy and a wait for the stream; a round reads several
small tensors (accept count, next token, kind; a draft's ids and probabilities). to_host copies
them all into pinned host memory without blocking, then waits once. On the CPU there is nothing
to copy and the tensors come back as they are.
"""

from __future__ import annotations

import torch


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU tensors holding the values of `tensors` (each any shape), read in one wait on their device."""
    if all(t.device.type == "cpu" for t in tensors):
        return list(tensors)
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda") for t in tensors]
    for target, source in zip(host, tensors):
        target.copy_(source, non_blocking=True)
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()  # the copies were queued on it: their values are in now
    return host
