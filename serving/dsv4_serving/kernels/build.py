"""Build a C++ kernel on first use, or say why it cannot be built.

The build goes through ``torch.utils.cpp_extension.load`` (g++ and ninja; cached under
``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, so only the first start of a machine
pays for it). ``DSV4_KERNELS=off`` skips every build (the pure-torch paths run instead).
"""

from __future__ import annotations

import logging
import os
import shutil
from functools import cache
from pathlib import Path
from types import ModuleType

log = logging.getLogger("dsv4.kernels")
HERE = Path(__file__).parent


class KernelUnavailable(RuntimeError):
    """The kernel cannot run here; the message says why."""


@cache
def build(name: str) -> ModuleType:
    if os.environ.get("DSV4_KERNELS", "on") == "off":
        raise KernelUnavailable("DSV4_KERNELS=off")
    missing = [tool for tool in ("g++", "ninja") if shutil.which(tool) is None]
    if missing:
        raise KernelUnavailable(f"no {' or '.join(missing)} on PATH to build {name}")
    from torch.utils.cpp_extension import load

    try:
        module: ModuleType = load(
            name=f"dsv4_{name}",
            sources=[str(HERE / f"{name}.cpp")],
            extra_cflags=["-O3", "-march=native", "-ffp-contract=fast"],
            verbose=False,
        )
    except Exception as exc:  # a compiler error is a reason to fall back, not to crash
        raise KernelUnavailable(f"building {name} failed: {exc}") from exc
    return module


def available(name: str) -> bool:
    try:
        build(name)
        return True
    except KernelUnavailable as exc:
        log.info("kernel %s unavailable (%s): using the pure-torch path", name, exc)
        return False
