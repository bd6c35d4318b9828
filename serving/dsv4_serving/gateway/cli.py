"""``dsv4 gateway``: the OpenAI-compatible front with PD orchestration and DPLB routing. Its
flags are ``GatewayConfig``'s fields; only the API key comes another way (a file or the
environment, never the command line)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dsv4_common.config_cli import add_config_arguments, config_from_args
from dsv4_serving.gateway.config import GatewayConfig

# the flags' historic spellings, kept working (the operator and `dsv4 up` use some of them)
_ALIASES = {
    "prefill_urls": ["--prefill"],
    "decode_urls": ["--decode"],
    "both_urls": ["--engine"],
    "prefill_timeout_s": ["--prefill-timeout"],
    "first_byte_timeout_s": ["--first-byte-timeout"],
    "stream_idle_timeout_s": ["--stream-idle-timeout"],
    "health_interval_s": ["--health-interval"],
}
_URL = {name: "URL" for name in ("prefill_urls", "decode_urls", "both_urls")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, GatewayConfig, exclude=("api_key",), aliases=_ALIASES, metavars=_URL)
    p.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="require the key in this file (default: $DSV4_GATEWAY_API_KEY if set)",
    )


def config(args: argparse.Namespace, env: dict[str, str]) -> GatewayConfig:
    """Environment < flags; the API key from ``--api-key-file`` or ``$DSV4_GATEWAY_API_KEY``."""
    api_key = env.get("DSV4_GATEWAY_API_KEY")
    if args.api_key_file is not None:
        try:
            api_key = args.api_key_file.read_text().strip()
        except OSError as e:
            raise ValueError(f"--api-key-file: {e}") from None
    base = {"namespace": env["POD_NAMESPACE"]} if env.get("POD_NAMESPACE") else {}
    return config_from_args(GatewayConfig, args, base=base, api_key=api_key or None)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from dsv4_serving.gateway.app import create_app

    try:
        cfg = config(args, dict(os.environ))
    except ValueError as e:
        raise SystemExit(f"dsv4 gateway: error: {e}") from None
    # SIGTERM drains first (create_app's lifespan, up to --shutdown-timeout); uvicorn's own
    # grace only covers what a drain that ran out of time left behind
    uvicorn.run(
        create_app(cfg),
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return 0
