"""Build a C++ kernel on first use, or say why it cannot be built.

The build goes through ``torch.utils.cpp_extension.load`` (g++ and ninja; cached under
``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, so only the first start of a machine
pays for it). ``DSV4_KERNELS=off`` skips every build (the pure-torch paths run instead).

A ``variant`` builds the same source with other flags under another name: ``avx2`` turns off
AVX-512 so an AVX-512 machine can test the AVX2 code path too.
"""

from __future__ import annotations

import logging
import os
import shutil
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("dsv4.kernels")
HERE = Path(__file__).parent


# kernels whose at::parallel_for runs on torch's OpenMP pool (without -fopenmp it runs serially);
# the extension's libgomp.so.1 resolves to the one torch already loaded, so there is one pool
OPENMP = {"w8a8", "fp8", "mhc", "paged_mla", "v4_attn"}
VARIANTS = {"": [], "avx2": ["-mno-avx512f"]}


class KernelUnavailable(RuntimeError):
    """The kernel cannot run here; the message says why."""


@cache
def build(name: str, variant: str = "") -> ModuleType:
    if os.environ.get("DSV4_KERNELS", "on") == "off":
        raise KernelUnavailable("DSV4_KERNELS=off")
    missing = [tool for tool in ("g++", "ninja") if shutil.which(tool) is None]
    if missing:
        raise KernelUnavailable(f"no {' or '.join(missing)} on PATH to build {name}")
    from torch.utils.cpp_extension import load

    omp = ["-fopenmp"] if name in OPENMP else []
    try:
        module: ModuleType = load(
            name=f"dsv4_{name}" + (f"_{variant}" if variant else ""),
            sources=[str(HERE / f"{name}.cpp")],
            extra_cflags=["-O3", "-march=native", "-ffp-contract=fast", *omp, *VARIANTS[variant]],
            extra_ldflags=omp,
            verbose=False,
        )
    except Exception as exc:  # a compiler error is a reason to fall back, not to crash
        raise KernelUnavailable(f"building {name} failed: {exc}") from exc
    return module


def available(name: str, variant: str = "") -> bool:
    try:
        build(name, variant)
        return True
    except KernelUnavailable as exc:
        log.info("kernel %s unavailable (%s): using the pure-torch path", name, exc)
        return False


class CpuKernel:
    """A quant method's handle on a kernel, resolved on first use (the build is cached per
    process). ``use_kernel``: None uses it on CPU when it builds, True requires it, False
    never. ``variant``: another build of the source (``VARIANTS``; benchmarks)."""

    name = ""
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)

    def __init__(self, use_kernel: bool | None = None, variant: str = "") -> None:
        self.use_kernel = use_kernel
        self.variant = variant
        self._ext: ModuleType | None = None
        self._resolved = use_kernel is False

    def get(self, x: torch.Tensor) -> ModuleType | None:
        """The extension if it applies to ``x`` (CPU, one of ``dtypes``), else None."""
        if not self._resolved:
            self._resolved = True
            if self.use_kernel or available(self.name, self.variant):
                self._ext = build(self.name, self.variant)  # KernelUnavailable if required
        if self._ext is not None and x.device.type == "cpu" and x.dtype in self.dtypes:
            return self._ext
        return None
