"""Linear layers that keep a oneDNN-prepacked copy of their weight for products of several rows.

On a CPU a one-token step of a model this size is bound by reading its weights, and torch's
matrix product reads them at about that rate for one row. For a few rows (a verify of K+1
tokens, one forward over several sessions' steps) it lays the weight out anew for its kernel
on every call, and with the default target on one core a 5-token forward cost ~2x a 1-token
one. oneDNN can take a weight laid out once, at load time; with it the same forward cost
~1.66x (`python tools/measure_prepack.py --cpu 0` times both side by side). A 1-row product
stays on the plain weight, where torch's own kernel is the faster of the two. The price is a
second copy of every linear weight in memory.

A prepacked product sums in another order than torch's, so its results differ in the last bits,
as a K+1-token verify's already differ from a one-token step's: greedy outputs differ only at
near-ties, specd's rule for any two forwards. A probe checks, before any layer is replaced,
that the packed product agrees with torch's to rounding; where the oneDNN operators are missing
or disagree, the model is left as it was.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

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


class PrepackedLinear(nn.Module):
    """An nn.Linear's weight and bias (the same Parameters, so tying and state_dict hold), with
    products of more than one row taken on a prepacked copy of the weight."""

    def __init__(self, linear: nn.Linear, rows_hint: int = ROWS_HINT):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed_weight = _pack(linear.weight, rows_hint)  # a plain attribute: not in state_dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        if rows <= 1 or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features).contiguous()  # [rows, in]
        out = _packed_product(flat, self.packed_weight, self.bias)  # [rows, out]
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _eligible(module: nn.Module) -> bool:
    """A plain float32 Linear on the CPU whose weight is an ordinary tensor and around which
    nothing is hooked (tensor parallelism's collectives, accelerate's device moves)."""
    if type(module) is not nn.Linear or hasattr(module, "_hf_hook"):
        return False
    if module._forward_hooks or module._forward_pre_hooks:
        return False
    weight = module.weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and type(weight.data) is torch.Tensor


@torch.inference_mode()
def _agrees(linear: nn.Linear, rows_hint: int) -> bool:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, linear.in_features, generator=generator)  # [5, in]
    want = F.linear(x, linear.weight, linear.bias)  # [5, out]
    got = _packed_product(x, _pack(linear.weight, rows_hint), linear.bias)  # [5, out]
    return torch.allclose(want, got, rtol=1e-4, atol=1e-5)


def prepack_linears(model: nn.Module, rows_hint: int = ROWS_HINT) -> int:
    """Replace every eligible nn.Linear in `model` by a PrepackedLinear; return how many."""
    found = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if _eligible(child)
    ]
    if not found:
        return 0
    if not _ops_available():
        log.info("oneDNN's prepacked linear operators are not in this torch: linear layers stay as they are")
        return 0
    try:
        agrees = _agrees(found[0][2], rows_hint)
    except RuntimeError as error:
        log.warning("prepacked linear layers do not run here (%s): linear layers stay as they are", error)
        return 0
    if not agrees:
        log.warning("prepacked linear products disagree with torch's here: linear layers stay as they are")
        return 0
    replacements: dict[int, PrepackedLinear] = {}  # one copy for a layer two parents share
    for parent, name, child in found:
        if id(child) not in replacements:
            replacements[id(child)] = PrepackedLinear(child, rows_hint)
        setattr(parent, name, replacements[id(child)])
    extra_mb = sum(linear.weight.numel() * linear.weight.element_size() for linear in replacements.values()) / 2**20
    log.info("prepacked %d linear layers for forwards of several tokens (+%.0f MiB)", len(replacements), extra_mb)
    return len(replacements)
