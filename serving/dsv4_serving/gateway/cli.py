"""``dsv4 gateway``: the OpenAI-compatible front with PD orchestration and DPLB routing."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--prefill", action="append", default=[], metavar="URL", help="prefill engine (repeatable)"
    )
    p.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="decode engine (repeatable)"
    )
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="URL",
        help="engine doing both prefill and decode (repeatable)",
    )
    p.add_argument("--discovery", choices=["static", "kubernetes"], default="static")
    p.add_argument(
        "--namespace",
        default=os.environ.get("POD_NAMESPACE", "default"),
        help="kubernetes discovery: namespace",
    )
    p.add_argument(
        "--selector", default="", help="kubernetes discovery: EndpointSlice label selector"
    )
    p.add_argument("--kubeconfig", default=None)
    p.add_argument("--policy", choices=["dplb", "least_load", "round_robin"], default="dplb")
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--selective-pd-tokens",
        type=int,
        default=0,
        help="uncached prompts shorter than this skip prefill (0: off)",
    )
    p.add_argument(
        "--block-size", type=int, default=16, help="engines' prefix-cache block size (tokens)"
    )
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer.json for exact prefix hashes (default: bytes)"
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="require this key (default: $DSV4_GATEWAY_API_KEY if set)",
    )
    p.add_argument("--max-inflight", type=int, default=1024)
    p.add_argument("--retries", type=int, default=1)
    p.add_argument("--prefill-timeout", type=float, default=600.0)
    p.add_argument("--first-byte-timeout", type=float, default=600.0)
    p.add_argument("--stream-idle-timeout", type=float, default=300.0)
    p.add_argument("--health-interval", type=float, default=2.0)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from dsv4_serving.gateway.app import create_app
    from dsv4_serving.gateway.config import GatewayConfig

    api_key = os.environ.get("DSV4_GATEWAY_API_KEY")
    if args.api_key_file is not None:
        try:
            api_key = args.api_key_file.read_text().strip()
        except OSError as e:
            raise SystemExit(f"dsv4 gateway: error: --api-key-file: {e}") from None
    if args.tokenizer and not Path(args.tokenizer).is_file():
        raise SystemExit(f"dsv4 gateway: error: --tokenizer {args.tokenizer}: no such file")
    try:
        cfg = GatewayConfig(
            host=args.host,
            port=args.port,
            prefill_urls=args.prefill,
            decode_urls=args.decode,
            both_urls=args.engine,
            discovery=args.discovery,
            namespace=args.namespace,
            selector=args.selector,
            kubeconfig=args.kubeconfig,
            policy=args.policy,
            served_model_name=args.served_model_name,
            selective_pd_tokens=args.selective_pd_tokens,
            block_size=args.block_size,
            api_key=api_key or None,
            max_inflight=args.max_inflight,
            retries=args.retries,
            prefill_timeout_s=args.prefill_timeout,
            first_byte_timeout_s=args.first_byte_timeout,
            stream_idle_timeout_s=args.stream_idle_timeout,
            health_interval_s=args.health_interval,
        )
    except ValueError as e:
        raise SystemExit(f"dsv4 gateway: error: {e}") from None
    uvicorn.run(
        create_app(cfg, args.tokenizer),
        host=cfg.host,
        port=cfg.port,
        log_level=args.log_level,
        access_log=False,
    )
    return 0
