"""Helpers for tests of specd's CPU products (the few-row kernel, oneDNN's prepacked weights):
skip marks, a kernel that counts what it takes, and forwards fed side by side."""

from __future__ import annotations

import platform
import shutil
from typing import Callable

import pytest
import torch

from specd.engine.backends.cpu_kernels import prepacked_linear
from specd.engine.backends.cpu_kernels.prepacked_linear import PrepackedLinear
from specd.engine.kv_cache import GrowingKVCache

builds_here = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64") or not (shutil.which("cc") or shutil.which("gcc")),
    reason="the kernel is for x86-64 and is built with the machine's C compiler",
)
needs_onednn = pytest.mark.skipif(not prepacked_linear._ops_available(), reason="torch built without oneDNN")

FEED_LENGTHS = (12, 5, 1, 8, 3)  # tokens per forward: past the kernel's 8 rows, within them, one
# (in, out) of kernel products: inner widths that fill whole 64-byte lines of weights (64, 576,
# 1536: what models have) and ones that end part-way through a line (40, 56), since the kernel
# walks a weight row a line at a time, then finishes it eight weights at a time.
INNER_OUT = [(64, 24), (576, 192), (1536, 40), (40, 24), (56, 16)]


class CountingKernel:
    """The real kernel, noting (rows, weight dtype) of each product it takes."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.calls: list[tuple[int, torch.dtype]] = []

    def product(self, x, weight, bias):
        self.calls.append((x.shape[0], weight.dtype))
        return self.kernel.product(x, weight, bias)

    @property
    def rows(self) -> list[int]:
        return [rows for rows, _ in self.calls]


def count_kernel_products(model: torch.nn.Module, kernel) -> tuple[CountingKernel, int]:
    """Put a CountingKernel in every prepacked layer of `model`: (it, how many layers)."""
    products = [m.product for m in model.modules() if isinstance(m, PrepackedLinear)]
    counter = CountingKernel(kernel)
    for product in products:
        product.kernel = counter
    return counter, len(products)


def feed_side_by_side(reference_for: Callable[[int], torch.nn.Module], model: torch.nn.Module, vocab: int) -> None:
    """Feed FEED_LENGTHS tokens at a time to `model` and to `reference_for(tokens)`, each on its
    own cache, and check their logits agree to rounding at every forward."""
    generator = torch.Generator().manual_seed(0)
    feeds = [torch.randint(1, vocab, (1, n), generator=generator) for n in FEED_LENGTHS]  # [1, n] each
    with torch.inference_mode():
        caches = GrowingKVCache(), GrowingKVCache()
        for ids in feeds:
            want = reference_for(ids.shape[1])(input_ids=ids, past_key_values=caches[0], use_cache=True).logits  # [1, n, V]
            got = model(input_ids=ids, past_key_values=caches[1], use_cache=True).logits  # [1, n, V]
            assert torch.allclose(want, got, rtol=1e-4, atol=1e-4), f"{ids.shape[1]} tokens"
            assert want.argmax(-1).equal(got.argmax(-1)), f"{ids.shape[1]} tokens"
