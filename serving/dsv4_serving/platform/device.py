"""The device platform: npu (through torch_npu, imported only when used), cuda or cpu.

Chosen automatically in that order, overridable by name (``--device`` / ``DSV4_DEVICE``).
Asking for a device that is not there is a clear error, never a silent fallback.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Literal

PlatformName = Literal["cpu", "cuda", "npu"]
NAMES: tuple[PlatformName, ...] = ("npu", "cuda", "cpu")


class PlatformError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Platform:
    name: PlatformName
    # collective backend for process groups on this platform
    dist_backend: str
    # why it was chosen, for `dsv4 explain-model`
    reason: str

    def torch_device(self, index: int = 0) -> Any:
        import torch

        if self.name == "cpu":
            return torch.device("cpu")
        return torch.device(self.name, index)

    def set_device(self, index: int) -> None:
        """Make device ``index`` (a rank's local rank) this process's current device."""
        if self.name == "cpu":
            return
        import torch

        if self.name == "npu":
            importlib.import_module("torch_npu").npu.set_device(index)
        else:
            torch.cuda.set_device(index)


def _torch_npu_present() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def _npu_available() -> bool:
    if not _torch_npu_present():
        return False
    torch_npu = importlib.import_module("torch_npu")  # registers the "npu" device with torch
    try:
        return bool(torch_npu.npu.is_available())
    except Exception:  # a broken CANN install reads as "not available"
        return False


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def get_platform(name: str) -> Platform:
    """The named platform, checked to be usable here."""
    if name == "cpu":
        return Platform("cpu", "gloo", "requested cpu")
    if name == "cuda":
        if not _cuda_available():
            raise PlatformError("device 'cuda' requested but torch sees no CUDA device")
        return Platform("cuda", "nccl", "requested cuda")
    if name == "npu":
        if not _torch_npu_present():
            raise PlatformError(
                "device 'npu' requested but torch_npu is not installed: install the torch_npu "
                "build that matches the CANN toolkit of this image (the 'npu' extra)"
            )
        if not _npu_available():
            raise PlatformError(
                "device 'npu' requested; torch_npu imports but reports no usable NPU "
                "(check the Ascend driver, ASCEND_RT_VISIBLE_DEVICES and the device plugin)"
            )
        return Platform("npu", "hccl", "requested npu")
    raise PlatformError(f"unknown device {name!r}; choose one of {', '.join(NAMES)} or 'auto'")


def detect_platform(requested: str | None = None) -> Platform:
    """``requested`` (or ``DSV4_DEVICE``) if set and not 'auto'; otherwise npu > cuda > cpu."""
    requested = requested or os.environ.get("DSV4_DEVICE") or "auto"
    if requested != "auto":
        return get_platform(requested)
    if _npu_available():
        return Platform("npu", "hccl", "auto: torch_npu reports an NPU")
    if _cuda_available():
        return Platform("cuda", "nccl", "auto: torch sees a CUDA device")
    why = "no torch_npu" if not _torch_npu_present() else "torch_npu sees no NPU"
    return Platform("cpu", "gloo", f"auto: {why}, no CUDA device")
