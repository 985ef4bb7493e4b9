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

import torch

from specd.engine.backends.base import Backend, FastPathOptions
from specd.engine.backends.cpu import CpuBackend
from specd.engine.backends.cuda import CudaBackend

__all__ = ["Backend", "FastPathOptions", "backend_for", "resolve_device"]


def resolve_device(device: str) -> str:
    """`auto`: cuda where torch sees a GPU, else cpu; any other name as it is."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def backend_for(device: str) -> Backend:
    """The backend of a worker's --device, chosen once."""
    device = resolve_device(device)
    kind = torch.device(device).type
    if kind == "cpu":
        return CpuBackend(device)
    if kind == "cuda":
        return CudaBackend(device)
    backend = Backend(device)
    backend.name = kind
    return backend
