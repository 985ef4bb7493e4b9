"""specd's product for a few rows: x @ W.T over 1-8 rows that reads the weight once.

On a CPU, torch's kernels (and oneDNN's, on a prepacked weight) take a product of a few rows
at well under the rate they read weights for one row, so a verify of 4 tokens cost ~1.66x a
one-token step on oneDNN's prepacked weights though it reads the same weights.
`kernels/small_rows_linear.c` streams each weight row once with every input row's sum in a
register (`python benchmarks/measure_prepack.py` times it beside the other products); for one row
it also reads faster than torch's product. It is C, built with the machine's C compiler the first
time a worker needs it and kept in specd's cache folder; where there is no compiler, no
x86-64 CPU with AVX2 and FMA, or the build fails, `load()` says so once and returns None,
and products stay on oneDNN's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import torch
import torch.nn.functional as F

from specd.engine.cache_dir import cache_root

log = logging.getLogger(__name__)

MAX_ROWS = 8  # the kernel keeps one register of sums per row; AVX2 has 16
SOURCE = pathlib.Path(__file__).with_name("small_rows_linear.c")
BUILD_TIMEOUT_S = 120.0


class SmallRowsKernel:
    """The built kernel, loaded: `product(x, weight, bias)` for 1..MAX_ROWS rows, on a float32 or
    a bfloat16 weight (read as it is, widened in registers: a draft's halved products,
    specd/engine/backends/cpu_kernels/prepacked_linear.py)."""

    WEIGHT_DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, library: ctypes.CDLL):
        argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        self._linear = {torch.float32: library.specd_small_rows_linear, torch.bfloat16: library.specd_small_rows_linear_bf16}
        for function in self._linear.values():
            function.restype = None
            function.argtypes = argtypes

    @classmethod
    def takes(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether the kernel can take products of this weight [out, in] (float32 or bfloat16) and bias [out] (float32)."""
        placed = [weight] if bias is None else [weight, bias]
        return (
            weight.dim() == 2 and weight.shape[1] % 8 == 0 and weight.dtype in cls.WEIGHT_DTYPES
            and (bias is None or bias.dtype == torch.float32)
            and all(t.device.type == "cpu" and t.is_contiguous() for t in placed)
        )

    def product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] (contiguous float32, 1 <= rows <= MAX_ROWS) @ weight.T [in, out] (+ bias [out])
        -> [rows, out], for a weight and bias the kernel `takes`."""
        rows, out, inner = x.shape[0], weight.shape[0], weight.shape[1]
        if not 1 <= rows <= MAX_ROWS:  # the kernel has a register of sums for MAX_ROWS rows, no more
            raise ValueError(f"specd's few-row product takes 1 to {MAX_ROWS} rows, not {rows}")
        y = torch.empty(rows, out, dtype=torch.float32)  # [rows, out]
        bias_pointer = bias.data_ptr() if bias is not None else None
        # ctypes lets go of the GIL for the call: a worker's gRPC threads run meanwhile.
        self._linear[weight.dtype](x.data_ptr(), rows, weight.data_ptr(), out, inner, bias_pointer, y.data_ptr())
        return y


def _build(target: pathlib.Path) -> None:
    """Compile SOURCE into the shared library `target` (written whole or not at all: several
    workers may build it at once)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc, gcc, or $CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        subprocess.run(
            [compiler, "-O3", "-shared", "-fPIC", "-o", partial, str(SOURCE)],
            check=True, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
        )
        os.chmod(partial, 0o755)  # mkstemp made it private; a cache built by root serves other users
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _library_path() -> pathlib.Path:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]  # a changed source builds anew
    return cache_root() / "kernels" / f"small_rows_linear-{digest}-{platform.machine()}.so"


@functools.lru_cache(maxsize=1)
def load() -> SmallRowsKernel | None:
    """The kernel, built on first use; None (said once, in the log) where it cannot run here."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        log.info("specd's few-row product is for x86-64 CPUs: products of a few rows stay on oneDNN's")
        return None
    path = _library_path()
    try:
        if not path.exists():
            _build(path)
            log.info("built specd's few-row product into %s", path)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("specd's few-row product could not be built (%s): products of a few rows stay on oneDNN's", detail)
        return None
    if not library.specd_small_rows_supported():
        log.info("this CPU lacks AVX2 or FMA: products of a few rows stay on oneDNN's")
        return None
    return SmallRowsKernel(library)


@torch.inference_mode()
def agrees_with_torch(kernel: SmallRowsKernel) -> bool:
    """Whether the kernel's products, on a float32 weight and on a bfloat16 one, agree with
    torch's product (on the bfloat16 weight widened) to rounding, for 2 and 5 rows."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 64, generator=generator)  # [out, in]
    bias = torch.randn(24, generator=generator)  # [out]
    x = torch.randn(5, 64, generator=generator)  # [5, in]
    halved = weight.to(torch.bfloat16)  # [out, in]
    return all(
        torch.allclose(F.linear(x[:rows], w.float(), bias), kernel.product(x[:rows].contiguous(), w, bias), rtol=1e-4, atol=1e-5)
        for rows in (2, 5)
        for w in (weight, halved)
    )


def load_checked() -> SmallRowsKernel | None:
    """The kernel, where it builds here and agrees with torch's product (said once, in the log, where not)."""
    kernel = load()
    if kernel is None:
        return None
    if not agrees_with_torch(kernel):
        log.warning("specd's few-row product disagrees with torch's here: products of a few rows stay on oneDNN's")
        return None
    return kernel
