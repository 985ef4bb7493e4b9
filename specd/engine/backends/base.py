"""What every device backend shares: the fast-path options a worker allows, and the backend
with none of its own (specd/engine/backends/__init__.py picks one)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class FastPathOptions:
    """Which fast paths a worker allows (its flags); a backend takes those that fit it and the model."""

    prepack_weights: bool = True  # CPU: oneDNN-prepacked copies of the linear weights
    few_row_kernel: bool = True  # CPU: specd's kernel for products of 1-8 rows
    halved: bool = False  # CPU: a draft's bfloat16 copies for the kernel's products (never a target's)
    grouped_attention: bool = True  # CPU: query heads attend in groups on shared key/value heads


class Backend:
    """A device with no fast paths of its own: the model's forwards as transformers runs them."""

    name = "generic"
    default_dtype = "float32"  # the weights' dtype when a worker's --dtype is auto
    # A draft's forwards through specd's lean Llama loop (specd/engine/lean_llama.py): on a CPU a
    # small model's step is mostly Python around the arithmetic, which that loop skips.
    lean_forward = False

    def __init__(self, device: str):
        self.device = device  # a torch device string: cpu, cuda, cuda:1, ...

    def dtype(self, asked: str) -> str:
        """The weights' dtype: `asked`, or this backend's default for auto."""
        return self.default_dtype if asked == "auto" else asked

    def set_threads(self, threads: int) -> None:
        """torch's intra-op threads (0: torch's own count)."""
        if threads > 0:
            torch.set_num_threads(threads)

    def prepare(self, model, options: FastPathOptions) -> list[str]:
        """Set the model up for this device; the fast paths it took."""
        return []
