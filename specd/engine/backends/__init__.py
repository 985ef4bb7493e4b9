"""Device backends: each worker picks one once, from its device, and it sets the model up.

    backend = backend_for(config.device)      # cpu, cuda (auto: cuda where torch sees a GPU)
    backend.set_threads(config.threads)
    loaded = load_causal_lm(..., device=backend.device)
    fast_paths = backend.prepare(loaded.model, options)

The worker logs the backend and the fast paths its model took, and reports them in its Info and
its specd_backend_info metric. The CPU backend's fast paths: specd/engine/backends/cpu.py; the
CUDA backend: specd/engine/backends/cuda.py.
"""

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


def resolve_device(device: str) -> str:
    """`auto`: cuda where torch sees a GPU, else cpu; any other name as it is."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def backend_for(device: str) -> Backend:
    """The backend of a worker's --device, chosen once."""
    from specd.engine.backends.cpu import CpuBackend
    from specd.engine.backends.cuda import CudaBackend

    device = resolve_device(device)
    kind = torch.device(device).type
    if kind == "cpu":
        return CpuBackend(device)
    if kind == "cuda":
        return CudaBackend(device)
    backend = Backend(device)
    backend.name = kind
    return backend
