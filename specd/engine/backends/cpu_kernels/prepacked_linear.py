"""Linear layers that keep a oneDNN-prepacked copy of their weight for products of several rows.

On a CPU a one-token step of a model this size is bound by reading its weights, and torch's
matrix product reads them at about that rate for one row. For a few rows (a verify of K+1
tokens, one forward over several sessions' steps) it lays the weight out anew for its kernel
on every call, and with the default target on one core a 5-token forward cost ~2x a 1-token
one. oneDNN can take a weight laid out once, at load time; with it the same forward cost
~1.66x (`python benchmarks/measure_prepack.py --cpu 0` times them side by side). Products of 1-8
rows on one thread go to specd's own kernel where it builds and runs (specd/engine/backends/cpu_kernels/small_rows_kernel.py),
which reads the plain weight once for all of them, and for one row reads it faster than torch's
product does; more rows, or more threads, to oneDNN (one row on more threads: torch's product).
The price is a second copy of every linear weight in memory. A draft's products may go further
(`halved`): a third, bfloat16 copy that the kernel reads for 1-8 rows at half the bytes (the
draft worker's `--few-row-bf16`). A module that is not an nn.Linear but takes such a product of
its `weight` (the draft's reduced output layer) opts in by defining `use_packed_product(product)`
and is handed a PackedProduct.

A prepacked product sums in another order than torch's, so its results differ in the last bits,
as a K+1-token verify's already differ from a one-token step's: greedy outputs differ only at
near-ties, specd's rule for any two forwards. A probe checks, before any layer is replaced,
that the packed product agrees with torch's to rounding; where the oneDNN operators are missing
or disagree, the model is left as it was.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from torch import nn

from specd.engine.backends.cpu_kernels import small_rows_kernel
from specd.engine.backends.cpu_kernels.small_rows_kernel import SmallRowsKernel

log = logging.getLogger(__name__)

ROWS_HINT = 8  # the row count oneDNN lays the weight out for: a verify at K = 4..8, a small batch


def _ops_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and mkldnn is not None
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


def _pack(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)  # opaque oneDNN layout of [out, in]


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # [rows, in] -> [rows, out]


class PackedProduct:
    """x @ weight.T (+ bias) for a weight [out, in] that keeps a prepacked copy: products of
    1..MAX_ROWS rows on one thread go to specd's few-row kernel (when given one), other products
    of more than one row to oneDNN on that copy, and the rest (one row on more threads or
    without the kernel, or gradients enabled) to torch's product on the weight.

    With `halved` (and a kernel), the product also keeps a bfloat16 copy of the weight, which the
    kernel reads instead, at half the bytes, widening it to float32 in registers: the products
    differ from float32's by the weight's rounding, so only a draft takes them (see prepack_linears)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rows_hint: int = ROWS_HINT,
        kernel: SmallRowsKernel | None = None,
        halved: bool = False,
    ):
        self.weight = weight
        self.bias = bias
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.packed_weight = _pack(weight, rows_hint)
        self.kernel = kernel if kernel is not None and SmallRowsKernel.takes(weight, bias) else None
        halves = halved and self.kernel is not None
        self.half_weight = weight.detach().to(torch.bfloat16).contiguous() if halves else None  # [out, in]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        if torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        few = self.kernel is not None and 1 <= rows <= small_rows_kernel.MAX_ROWS and x.dtype == torch.float32 \
            and torch.get_num_threads() == 1
        if few:
            weight = self.half_weight if self.half_weight is not None else self.weight
            flat = x.reshape(rows, self.in_features).contiguous()  # [rows, in]
            return self.kernel.product(flat, weight, self.bias).reshape(*x.shape[:-1], self.out_features)  # [..., out]
        if rows <= 1:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features).contiguous()  # [rows, in]
        return _packed_product(flat, self.packed_weight, self.bias).reshape(*x.shape[:-1], self.out_features)


@contextlib.contextmanager
def float32_products(model: nn.Module):
    """Every prepacked product of `model` reads its float32 weight while this lasts. A bfloat16
    copy serves products of 1-8 rows only, so a forward's results depend on how many rows it
    has: a probe that compares forwards of different sizes (specd.engine.packed_forward's) checks its
    own mechanism on the float32 weights, not that rounding."""
    products = [value for module in model.modules() for value in vars(module).values() if isinstance(value, PackedProduct)]
    halves = [product.half_weight for product in products]
    for product in products:
        product.half_weight = None
    try:
        yield
    finally:
        for product, half in zip(products, halves):
            product.half_weight = half


class PrepackedLinear(nn.Module):
    """An nn.Linear's weight and bias (the same Parameters, so tying and state_dict hold), with
    its products taken as PackedProduct takes them (a prepacked copy, specd's kernel)."""

    def __init__(
        self, linear: nn.Linear, rows_hint: int = ROWS_HINT, kernel: SmallRowsKernel | None = None, halved: bool = False
    ):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.product = PackedProduct(linear.weight, linear.bias, rows_hint, kernel, halved)  # a plain attribute: not in state_dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self.product(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _unhooked(module: nn.Module) -> bool:
    """Nothing is hooked around it (tensor parallelism's collectives, accelerate's device moves)."""
    return not (hasattr(module, "_hf_hook") or module._forward_hooks or module._forward_pre_hooks)


def _packable(weight: torch.Tensor) -> bool:
    """A float32 weight on the CPU that is an ordinary tensor (not a tensor-parallel shard)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and type(weight.data) is torch.Tensor


def _eligible(module: nn.Module) -> bool:
    """A plain nn.Linear (not a subclass, whose forward may differ) with a float32 CPU weight, unhooked."""
    return type(module) is nn.Linear and _unhooked(module) and _packable(module.weight)


def _opts_in(module: nn.Module) -> bool:
    """A module that is not an nn.Linear but takes a product of its `weight` [out, in] (float32,
    on the CPU) the same way, and says so by defining `use_packed_product(product)`
    (specd.engine.draft_model's output layer): it takes any callable x -> x @ weight.T."""
    return callable(getattr(module, "use_packed_product", None)) and _unhooked(module) and _packable(module.weight)


def _probe_input(weight: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(5, weight.shape[1], generator=generator)  # [5, in]


@torch.inference_mode()
def _agrees(weight: torch.Tensor, bias: torch.Tensor | None, rows_hint: int) -> bool:
    x = _probe_input(weight)  # [5, in]
    want = F.linear(x, weight, bias)  # [5, out]
    got = _packed_product(x, _pack(weight, rows_hint), bias)  # [5, out]
    return torch.allclose(want, got, rtol=1e-4, atol=1e-5)


def prepack_linears(model: nn.Module, rows_hint: int = ROWS_HINT, few_row_kernel: bool = True, halved: bool = False) -> int:
    """Replace every eligible nn.Linear in `model` by a PrepackedLinear, and hand each module
    that opts in a PackedProduct of its weight; return how many weights were packed. With
    `few_row_kernel`, products of 1..MAX_ROWS rows on one thread go to specd's kernel where it
    runs here.

    With `halved` as well, the kernel takes those products on a bfloat16 copy of
    each weight (PackedProduct): for a draft, whose step reads its weights as the target's does
    and whose q may move in the last bits (the target's ratio test is exact for whatever q the
    draft reports). Never for a target: every exactness promise is made against its float32."""
    found = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if _eligible(child)
    ]
    opted = [module for module in model.modules() if _opts_in(module)]
    if not found and not opted:
        return 0
    if not _ops_available():
        log.info("oneDNN's prepacked linear operators are not in this torch: linear layers stay as they are")
        return 0
    probe = (found[0][2].weight, found[0][2].bias) if found else (opted[0].weight, None)
    try:
        agrees = _agrees(*probe, rows_hint)
    except RuntimeError as error:
        log.warning("prepacked linear layers do not run here (%s): linear layers stay as they are", error)
        return 0
    if not agrees:
        log.warning("prepacked linear products disagree with torch's here: linear layers stay as they are")
        return 0
    kernel = small_rows_kernel.load_checked() if few_row_kernel else None
    replacements: dict[int, PrepackedLinear] = {}  # one copy for a layer two parents share
    for parent, name, child in found:
        if id(child) not in replacements:
            replacements[id(child)] = PrepackedLinear(child, rows_hint, kernel, halved)
        setattr(parent, name, replacements[id(child)])
    products = [linear.product for linear in replacements.values()]
    for module in opted:
        products.append(PackedProduct(module.weight, None, rows_hint, kernel, halved))
        module.use_packed_product(products[-1])
    copies = [p.weight for p in products] + [p.half_weight for p in products if p.half_weight is not None]
    extra_mb = sum(copy.numel() * copy.element_size() for copy in copies) / 2**20  # the packed copy is the weight's size
    rows = ""
    if kernel is not None:
        halves = any(p.half_weight is not None for p in products)
        rows = f"; 1-{small_rows_kernel.MAX_ROWS} rows on specd's few-row kernel" + (", on bfloat16 copies" if halves else "")
    log.info("prepacked %d weights for forwards of several tokens (+%.0f MiB)%s", len(products), extra_mb, rows)
    return len(products)


def prepacked_paths(model: nn.Module) -> list[str]:
    """Which of this module's fast paths `model` took: prepacked_linear, few_row_kernel, few_row_bf16."""
    products = [value for module in model.modules() for value in vars(module).values() if isinstance(value, PackedProduct)]
    paths = ["prepacked_linear"] if products else []
    if any(product.kernel is not None for product in products) and torch.get_num_threads() == 1:
        paths.append("few_row_kernel")  # the kernel serves one thread only
    if any(product.half_weight is not None for product in products) and "few_row_kernel" in paths:
        paths.append("few_row_bf16")
    return paths
