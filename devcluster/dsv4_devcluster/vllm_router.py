"""vLLM's Rust router (PyPI ``vllm-router``), the gateway's point of comparison, installed once
into its own venv outside the repo. It lives in the dev cluster's package, with the other
harness pieces, because the gateway benchmark and the gateway tests both drive it, and an
installed module is what both can import (benchmarks never import ``tests/``)."""

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


def router_argv(exe: Path, prefills: list[str], decodes: list[str], port: int) -> list[str]:
    """vllm-router in PD mode on 127.0.0.1:``port`` (it takes the gateway's upstream flags)."""
    return [
        str(exe),
        "--vllm-pd-disaggregation",
        *(a for u in prefills for a in ("--prefill", u)),
        *(a for u in decodes for a in ("--decode", u)),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
