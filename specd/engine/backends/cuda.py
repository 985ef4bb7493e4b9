"""The CUDA backend: the model's forwards as transformers runs them on the GPU; the CPU backend's
fast paths (prepacked weights, the few-row kernel, grouped attention, thread counts beyond torch's
own) are CPU-only and stay off."""

from __future__ import annotations

from specd.engine.backends.base import Backend, FastPathOptions


class CudaBackend(Backend):
    name = "cuda"
    # A GPU step reads the weights: bfloat16 halves what it reads (exactness checks ask float32).
    default_dtype = "bfloat16"

    def prepare(self, model, options: FastPathOptions) -> list[str]:
        return []
