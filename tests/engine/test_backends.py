"""specd/engine/backends: a worker picks its backend once from its device; the CPU backend takes the
fast paths that fit the model, the CUDA backend none of the CPU's; the worker reports which it runs
(its Info, the specd_backend_info metric) and the coordinator takes that device's profile."""

from __future__ import annotations

import torch

from coordinator.profiles import CPU
from specd.engine.backends import Backend, FastPathOptions, backend_for
from specd.engine.backends.cpu import CpuBackend
from specd.engine.backends.cpu_kernels import small_rows_kernel
from specd.engine.backends.cuda import CudaBackend
from specd.v1 import draft_pb2, target_pb2
from tests.conftest import running_stack
from tests.tiny_models import build_llama

OFF = FastPathOptions(prepack_weights=False, few_row_kernel=False, grouped_attention=False)


def test_the_device_picks_the_backend():
    assert isinstance(backend_for("cpu"), CpuBackend) and backend_for("cpu").device == "cpu"
    assert isinstance(backend_for("cuda:1"), CudaBackend) and backend_for("cuda:1").device == "cuda:1"
    expected = CudaBackend if torch.cuda.is_available() else CpuBackend
    assert isinstance(backend_for("auto"), expected)
    other = backend_for("meta")
    assert type(other) is Backend and other.name == "meta" and other.prepare(None, FastPathOptions()) == []


def test_the_cpu_backend_takes_the_fast_paths_that_fit(one_thread):
    model = build_llama(96, seed=3, hidden=32, layers=2)  # 4 query heads on 2 key/value heads
    taken = CpuBackend("cpu").prepare(model, FastPathOptions())
    assert taken[0] == "prepacked_linear" and "grouped_attention" in taken
    assert ("few_row_kernel" in taken) == (small_rows_kernel.load_checked() is not None)
    assert "few_row_bf16" not in taken  # never for a target: only a draft asks for halved copies
    draft = CpuBackend("cpu").prepare(build_llama(96, seed=4, hidden=32, layers=2), FastPathOptions(halved=True))
    assert ("few_row_bf16" in draft) == ("few_row_kernel" in draft)
    assert CpuBackend("cpu").prepare(build_llama(96, seed=3, hidden=32, layers=2), OFF) == []


def test_the_few_row_kernel_is_reported_only_where_it_serves():
    """It takes products on one thread only: with more, the model never reaches it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        taken = CpuBackend("cpu").prepare(build_llama(96, seed=3, hidden=32, layers=2), FastPathOptions(halved=True))
    finally:
        torch.set_num_threads(before)
    assert "prepacked_linear" in taken and "few_row_kernel" not in taken and "few_row_bf16" not in taken


def test_the_cuda_backend_leaves_the_cpu_fast_paths_off():
    model = build_llama(96, seed=3, hidden=32, layers=2)
    before = {name: type(module) for name, module in model.named_modules()}
    assert CudaBackend("cuda").prepare(model, FastPathOptions()) == []
    assert {name: type(module) for name, module in model.named_modules()} == before
    assert model.config._attn_implementation == "sdpa"


def test_workers_report_their_backend_and_the_coordinator_takes_its_profile(tiny_pair):
    with running_stack(*tiny_pair) as stack:
        target = stack.run(stack.coordinator.servicer.target.info())
        draft = stack.coordinator.servicer.draft.info
        assert isinstance(target, target_pb2.TargetInfo) and isinstance(draft, draft_pb2.DraftInfo)
        assert target.backend == draft.backend == "cpu"
        assert "prepacked_linear" in target.fast_paths and "packed_forward" in target.fast_paths
        assert "lean_forward" in draft.fast_paths
        assert stack.coordinator.servicer.profile == CPU
        samples = {
            (s.name, s.labels["role"], s.labels["backend"]): s.labels["fast_paths"]
            for service in (stack.target, stack.draft)
            for family in service.servicer.metrics.registry.collect()
            for s in family.samples
            if s.name == "specd_backend_info"
        }
        assert samples[("specd_backend_info", "target", "cpu")] == ",".join(target.fast_paths)
        assert samples[("specd_backend_info", "draft", "cpu")] == ",".join(draft.fast_paths)


def test_each_backend_has_its_default_weights_dtype():
    """--dtype auto: float32 on a CPU (exactness is promised against it), bfloat16 on a GPU."""
    assert CpuBackend("cpu").dtype("auto") == "float32" and CudaBackend("cuda").dtype("auto") == "bfloat16"
    assert CudaBackend("cuda").dtype("float32") == "float32"  # asked: exactness checks run fp32 on a GPU too
