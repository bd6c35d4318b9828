"""Build a C++ kernel on first use, or say why it cannot be built.

The build goes through ``torch.utils.cpp_extension.load`` (g++ and ninja; cached under
``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, so only the first start of a machine
pays for it). ``DSV4_KERNELS=off`` skips every build (the pure-torch paths run instead).

A ``variant`` builds the same source with other flags under another name: ``avx2`` turns off
AVX-512 so an AVX-512 machine can test the AVX2 code path too, ``scalar`` turns off AVX2 and FMA
as well (the path of a CPU without them, and of the kernels' tails).

``python -m dsv4_serving.kernels.build`` builds every kernel (``make install``), one process per
kernel and as many at once as there are CPUs: each is one translation unit, so ninja alone keeps
one core busy and a cold machine paid for them one after another.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("dsv4.kernels")
HERE = Path(__file__).parent


# kernels whose at::parallel_for runs on torch's OpenMP pool (without -fopenmp it runs serially);
# the extension's libgomp.so.1 resolves to the one torch already loaded, so there is one pool
OPENMP = {"w8a8", "fp8", "mhc", "paged_mla", "v4_attn"}
VARIANTS = {"": [], "avx2": ["-mno-avx512f"], "scalar": ["-mno-avx512f", "-mno-avx2", "-mno-fma"]}


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
    full = f"dsv4_{name}" + (f"_{variant}" if variant else "")
    try:
        module: ModuleType = load(
            name=full,
            sources=[str(HERE / f"{name}.cpp")],
            build_directory=str(_build_dir(full)),
            extra_cflags=["-O3", "-march=native", "-ffp-contract=fast", *omp, *VARIANTS[variant]],
            extra_ldflags=omp,
            verbose=False,
        )
    except Exception as exc:  # a compiler error is a reason to fall back, not to crash
        raise KernelUnavailable(f"building {name} failed: {exc}") from exc
    return module


def _build_dir(name: str) -> Path:
    """One directory per kernel and virtual environment. Two venvs (a clean CI clone beside a
    working tree) build with different include paths: in torch's one shared directory each
    rebuilt the other's kernel at its next load, minutes of compiler inside tests."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache/torch_extensions")
    venv = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    d = Path(root) / f"dsv4-{venv}" / name
    d.mkdir(parents=True, exist_ok=True)
    return d


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


# every kernel `make install` prebuilds: (name, variant)
ALL = (
    ("paged_mla", ""),
    ("w8a8", ""),
    ("w8a8", "avx2"),
    ("fp8", ""),
    ("mhc", ""),
    ("mhc", "avx2"),
    ("mhc", "scalar"),
    ("v4_attn", ""),
    ("v4_attn", "avx2"),
    ("v4_attn", "scalar"),
)


def prebuild(kernels: tuple[tuple[str, str], ...] = ALL, jobs: int | None = None) -> list[str]:
    """Build ``kernels`` in ``jobs`` child processes (default: one per CPU), each taking its
    share in turn (one torch import per child, not per kernel: a warm cache costs seconds); the
    names of those that did not build (each child logs why; the engine falls back to torch)."""
    code = (
        "import sys\n"
        "from dsv4_serving.kernels.build import available\n"
        "for k in sys.argv[1:]:\n"
        "    if not available(*k.split(':')):\n"
        "        print(k.rstrip(':'))\n"
    )
    n = max(1, min(len(kernels), jobs or os.cpu_count() or 1))
    shares = [[f"{name}:{variant}" for name, variant in kernels[i::n]] for i in range(n)]

    def one(share: list[str]) -> list[str]:
        res = subprocess.run(
            [sys.executable, "-c", code, *share], stdout=subprocess.PIPE, text=True
        )
        if res.returncode != 0:
            return [k.rstrip(":") for k in share]
        return res.stdout.split()

    with ThreadPoolExecutor(n) as pool:
        return [k for failed in pool.map(one, shares) for k in failed]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="[kernels] %(message)s")
    failed = prebuild()
    if failed:
        log.info("not built (the pure-torch paths run instead): %s", ", ".join(failed))
