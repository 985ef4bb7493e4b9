"""The CPU backend: the fast paths of a model whose step is bound by reading its weights on a
few cores (specd/engine/backends/cpu_kernels/): prepacked linear layers, specd's few-row kernel
(on a draft, over bfloat16 copies), grouped attention. Each checks that it agrees with torch's
own result on the model here before it is used, and is left out where it does not."""

from __future__ import annotations

from specd.engine.backends.base import Backend, FastPathOptions


class CpuBackend(Backend):
    name = "cpu"
    lean_forward = True

    def prepare(self, model, options: FastPathOptions) -> list[str]:
        from specd.engine.backends.cpu_kernels.grouped_attention import use_grouped_attention
        from specd.engine.backends.cpu_kernels.prepacked_linear import prepack_linears, prepacked_paths

        taken = []
        if options.prepack_weights:
            prepack_linears(model, few_row_kernel=options.few_row_kernel, halved=options.halved)
            taken += prepacked_paths(model)
        if options.grouped_attention and use_grouped_attention(model):
            taken.append("grouped_attention")
        return taken
