"""vLLM's Rust router (PyPI `vllm-router`), installed once into its own venv outside the repo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROUTER_VENV = Path.home() / ".cache" / "dsv4" / "vllm-router-venv"
ROUTER_VERSION = "0.1.17"


def ensure_vllm_router() -> Path | None:
    """The vllm-router binary, installing it on first use; None if it cannot be installed."""
    exe = ROUTER_VENV / "bin" / "vllm-router"
    if exe.exists():
        return exe
    try:
        subprocess.run([sys.executable, "-m", "venv", str(ROUTER_VENV)], check=True, timeout=300)
        subprocess.run(
            [str(ROUTER_VENV / "bin" / "pip"), "install", "-q", f"vllm-router=={ROUTER_VERSION}"],
            check=True,
            timeout=600,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        print(f"vllm-router could not be installed: {e}", file=sys.stderr)
        return None
    return exe if exe.exists() else None
