"""specd/engine/backends/cpu_kernels/small_rows_kernel.py: the few-row product builds, agrees with torch's, and takes the
products of 1-8 rows on one thread it is meant for (and only those) inside a prepacked model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specd.engine.backends.cpu_kernels import prepacked_linear, small_rows_kernel
from specd.engine.backends.cpu_kernels.prepacked_linear import PrepackedLinear, prepack_linears
from tests.cpu_products import INNER_OUT, builds_here, count_kernel_products, feed_side_by_side, needs_onednn
from tests.tiny_models import build_llama

VOCAB = 96


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty specd cache folder, and load() forgetting what it loaded before."""
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    small_rows_kernel.load.cache_clear()
    yield tmp_path
    small_rows_kernel.load.cache_clear()


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        return True  # no /proc: let the kernel's own check speak
    return "avx2" in flags and "fma" in flags


@builds_here
def test_it_builds_once_into_the_cache_and_loads_from_there(fresh_cache):
    kernel = small_rows_kernel.load()
    if not _cpu_has_avx2_fma():
        assert kernel is None
        return
    assert kernel is not None
    built = list((fresh_cache / "kernels").glob("small_rows_linear-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    small_rows_kernel.load.cache_clear()
    assert small_rows_kernel.load() is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert not [p for p in (fresh_cache / "kernels").iterdir() if p != built[0]]  # no partial file left


def test_without_a_compiler_it_says_none_and_products_stay_on_onednn(fresh_cache, monkeypatch, one_thread):
    monkeypatch.setenv("CC", str(fresh_cache / "no-such-compiler"))
    assert small_rows_kernel.load() is None
    if not prepacked_linear._ops_available():
        return
    linear = torch.nn.Linear(64, 24)
    x = torch.randn(4, 64)  # [4, in]
    model = torch.nn.Sequential(linear)
    with torch.inference_mode():
        want = linear(x)  # [4, out]
        prepack_linears(model)
        assert model[0].product.kernel is None
        assert torch.allclose(model[0](x), want, rtol=1e-4, atol=1e-5)


@builds_here
@pytest.mark.parametrize("inner,out", INNER_OUT)
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_of_one_to_eight_rows_agree_with_torch(fresh_cache, inner, out, with_bias):
    kernel = small_rows_kernel.load()
    if kernel is None:
        pytest.skip("this CPU lacks AVX2 or FMA")
    generator = torch.Generator().manual_seed(inner + out)
    weight = torch.randn(out, inner, generator=generator)  # [out, in]
    bias = torch.randn(out, generator=generator) if with_bias else None  # [out]
    assert kernel.takes(weight, bias)
    for rows in range(1, small_rows_kernel.MAX_ROWS + 1):
        x = torch.randn(rows, inner, generator=generator)  # [rows, in]
        want = F.linear(x, weight, bias)  # [rows, out]
        got = kernel.product(x, weight, bias)  # [rows, out]
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), f"{rows} rows"


@builds_here
@pytest.mark.parametrize("inner", [128, 40])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(fresh_cache, inner):
    kernel = small_rows_kernel.load()
    if kernel is None:
        pytest.skip("this CPU lacks AVX2 or FMA")
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(40, inner, generator=generator)  # [out, in]
    x = torch.randn(8, inner, generator=generator)  # [8, in]
    alone = torch.cat([kernel.product(x[r : r + 1].contiguous(), weight, None) for r in range(8)])  # [8, out]
    for rows in range(2, 9):
        assert torch.equal(kernel.product(x[:rows].contiguous(), weight, None), alone[:rows]), f"{rows} rows"


@builds_here
def test_more_rows_than_it_has_registers_for_are_refused(fresh_cache):
    kernel = small_rows_kernel.load()
    if kernel is None:
        pytest.skip("this CPU lacks AVX2 or FMA")
    with pytest.raises(ValueError):
        kernel.product(torch.randn(small_rows_kernel.MAX_ROWS + 1, 64), torch.randn(8, 64), None)


def test_it_does_not_take_what_it_cannot_compute():
    assert not small_rows_kernel.SmallRowsKernel.takes(torch.randn(8, 36), None)  # in % 8
    assert not small_rows_kernel.SmallRowsKernel.takes(torch.randn(8, 64, dtype=torch.float64), None)
    assert not small_rows_kernel.SmallRowsKernel.takes(torch.randn(64, 8).t(), None)  # not contiguous
    assert not small_rows_kernel.SmallRowsKernel.takes(torch.randn(8, 64), torch.randn(8, dtype=torch.float64))
    assert small_rows_kernel.SmallRowsKernel.takes(torch.randn(8, 64), torch.randn(8))


@builds_here
@needs_onednn
def test_a_prepacked_model_sends_products_of_1_to_8_rows_on_one_thread_to_it(fresh_cache, one_thread):
    if small_rows_kernel.load() is None:
        pytest.skip("this CPU lacks AVX2 or FMA")
    plain = build_llama(VOCAB, seed=5, hidden=64, layers=2)
    packed = build_llama(VOCAB, seed=5, hidden=64, layers=2)
    assert prepack_linears(packed) > 0
    products = [m.product for m in packed.modules() if isinstance(m, PrepackedLinear)]
    assert all(p.kernel is not None for p in products)
    counter, layers = count_kernel_products(packed, products[0].kernel)
    feed_side_by_side(lambda tokens: plain, packed, VOCAB)
    # 12 tokens go to oneDNN; 5, 1, 8 and 3 to the kernel, every layer.
    assert sorted(set(counter.rows)) == [1, 3, 5, 8]
    assert len(counter.rows) == 4 * layers

    counter.calls.clear()
    torch.set_num_threads(2)  # more threads: oneDNN's threaded product and torch's, not the one-thread kernel
    with torch.inference_mode():
        packed(input_ids=torch.randint(1, VOCAB, (1, 5)))
        packed(input_ids=torch.randint(1, VOCAB, (1, 1)))
    assert counter.calls == []


@needs_onednn
def test_it_can_be_turned_off():
    model = build_llama(VOCAB, seed=6, hidden=64, layers=1)
    prepack_linears(model, few_row_kernel=False)
    assert all(m.product.kernel is None for m in model.modules() if isinstance(m, PrepackedLinear))


@builds_here
@needs_onednn
@pytest.mark.parametrize("few_row_kernel", [True, False])
def test_the_workers_take_the_kernel_unless_told_not_to(tiny_pair, few_row_kernel):
    from draft_service.config import DraftConfig
    from draft_service.server import load_runner as load_draft
    from target_service.config import TargetConfig
    from target_service.worker import load_runner as load_target

    if small_rows_kernel.load() is None:
        pytest.skip("this CPU lacks AVX2 or FMA")
    target, draft = tiny_pair
    runners = [
        load_target(TargetConfig(model=target, device="cpu", few_row_kernel=few_row_kernel)),
        load_draft(DraftConfig(model=draft, device="cpu", few_row_kernel=few_row_kernel)),
    ]
    for runner in runners:
        products = [m.product for m in runner.loaded.model.modules() if isinstance(m, PrepackedLinear)]
        assert products and all((p.kernel is not None) == few_row_kernel for p in products)


@builds_here
@needs_onednn
def test_a_kernel_that_disagrees_with_torch_is_not_used(fresh_cache, monkeypatch):
    if small_rows_kernel.load() is None:
        pytest.skip("this CPU lacks AVX2 or FMA")
    product = small_rows_kernel.SmallRowsKernel.product
    monkeypatch.setattr(
        small_rows_kernel.SmallRowsKernel, "product", lambda self, x, weight, bias: product(self, x, weight, bias) + 1e-3
    )
    model = build_llama(VOCAB, seed=8, hidden=64, layers=1)
    assert prepack_linears(model) > 0  # oneDNN's product still serves
    assert all(m.product.kernel is None for m in model.modules() if isinstance(m, PrepackedLinear))
