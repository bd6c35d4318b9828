"""``dsv4 engine``: serve one model over the OpenAI API.

Flags the operator passes are all accepted: ``--config`` (the deployment's engine.json),
``--role``, ``--model``, ``--served-model-name``, ``--host``, ``--port``, the parallel sizes,
``--num-speculative-tokens``, ``--device``, ``--rank-table``. Torch is imported only by the
engine-core process.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from dsv4_serving.engine.config import ConfigError, EngineConfig

log = logging.getLogger("dsv4.engine")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="engine.json written by the operator (CLI flags win)")
    p.add_argument("--model", help="checkpoint directory or preset name (dsv4-tiny, dsv3-small)")
    p.add_argument("--served-model-name", help="name clients pass as `model` (default: --model)")
    p.add_argument("--role", choices=["both", "prefill", "decode"], help="PD role (default both)")
    p.add_argument("--kv-sidecar", metavar="URL",
                   help="the local dsv4 kv-sidecar's control API, e.g. http://127.0.0.1:14580 "
                        "(required for --role prefill|decode)")  # fmt: skip
    p.add_argument("--kv-failure-policy", choices=["fail", "recompute"],
                   help="decode, when a KV pull fails: fail the request or prefill it here "
                        "(default recompute)")  # fmt: skip
    p.add_argument("--kv-pull-timeout", type=float, metavar="SECONDS",
                   help="decode: seconds to wait for a request's KV (default 30)")  # fmt: skip
    p.add_argument(
        "--kv-sidecar-wait",
        type=float,
        metavar="SECONDS",
        help="seconds to wait at start for the sidecar to answer (default 10)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", help="cpu | cuda | npu | auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--load-format", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--seed", type=int)
    p.add_argument("--tensor-parallel-size", type=int)
    p.add_argument("--data-parallel-size", type=int)
    p.add_argument("--expert-parallel-size", type=int)
    p.add_argument("--rank-table", help="HCCL rank table file (Ascend, multi-node)")
    p.add_argument("--num-speculative-tokens", type=int, help="MTP drafts per step, 0-3")
    p.add_argument("--block-size", type=int)
    p.add_argument("--num-kv-blocks", type=int, help="paged KV blocks (default: from memory)")
    p.add_argument("--kv-cache-memory-gb", type=float, help="CPU: memory for the KV pool")
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--num-prefix-state-snapshots", type=int)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=None)  # fmt: skip
    p.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   default=None)  # fmt: skip
    p.add_argument("--log-level", default="INFO")


# keys of the operator's engine.json that map onto the engine config
_FROM_DEPLOYMENT = {("model", "dtype"): "dtype", ("model", "maxModelLen"): "max_model_len"}


def config_from_file(path: str) -> dict[str, Any]:
    """The operator's engine.json: deployment-wide settings; an optional ``engine`` object
    holds engine config fields verbatim."""
    data = json.loads(Path(path).read_text())
    out: dict[str, Any] = {}
    for (section, key), field_name in _FROM_DEPLOYMENT.items():
        v = (data.get(section) or {}).get(key)
        if v is not None:
            out[field_name] = v
    out.update(data.get("engine") or {})
    return out


def build_config(args: argparse.Namespace) -> EngineConfig:
    values: dict[str, Any] = config_from_file(args.config) if args.config else {}
    for name in (
        "model", "served_model_name", "role", "device", "dtype", "load_format", "seed",
        "tensor_parallel_size", "data_parallel_size", "expert_parallel_size", "rank_table",
        "num_speculative_tokens", "block_size", "num_kv_blocks", "kv_cache_memory_gb",
        "gpu_memory_utilization", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
        "num_prefix_state_snapshots", "enable_prefix_caching", "enable_chunked_prefill",
        "kv_sidecar", "kv_failure_policy", "kv_pull_timeout", "kv_sidecar_wait",
    ):  # fmt: skip
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
    if "model" not in values:
        raise ConfigError("--model is required (a checkpoint directory or a preset name)")
    if values.get("dtype") not in (None, "auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"unsupported dtype {values['dtype']!r}")
    return EngineConfig.from_dict(values)


def check_sidecar(url: str, wait_s: float) -> None:
    """Fail fast (with the reason) unless the local KV sidecar answers within ``wait_s``."""
    import time

    from dsv4_kvtransfer.client import SidecarClient, SidecarError

    client = SidecarClient(url, timeout_s=2.0)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.info()
            return
        except SidecarError as exc:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"the KV sidecar at --kv-sidecar {url} does not answer ({exc}); start "
                    "`dsv4 kv-sidecar` first (its --control-port) or fix the URL"
                ) from None
        time.sleep(0.2)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        config = build_config(args)
        from dsv4_serving.presets.configs import PRESETS

        if config.model not in PRESETS and not Path(config.model).exists():
            raise ConfigError(
                f"model {config.model!r} is neither a directory nor a preset "
                f"({', '.join(sorted(PRESETS))})"
            )
        if config.device == "cpu":
            config.check_parallel("cpu")
        if config.rank_table and not Path(config.rank_table).is_file():
            raise ConfigError(f"rank table {config.rank_table} does not exist")
        if config.kv_sidecar:
            check_sidecar(config.kv_sidecar, config.kv_sidecar_wait)
    except (ConfigError, OSError, json.JSONDecodeError, TypeError) as exc:
        print(f"dsv4 engine: {exc}", file=sys.stderr)
        return 2
    return serve(config, args.host, args.port)


def serve(config: EngineConfig, host: str, port: int) -> int:
    import uvicorn

    from dsv4_serving.engine.async_llm import AsyncLLM, EngineDeadError
    from dsv4_serving.engine.tokenizer import load_tokenizer
    from dsv4_serving.entrypoints.api_server import build_app
    from dsv4_serving.entrypoints.metrics import EngineMetrics

    try:
        tokenizer = load_tokenizer(config.model)
    except (OSError, ValueError) as exc:
        print(f"dsv4 engine: {exc}", file=sys.stderr)
        return 1
    metrics = EngineMetrics(config.model_name)
    engine = AsyncLLM(config, tokenizer, metrics.on_event)
    try:
        info = engine.start()
    except EngineDeadError as exc:
        print(f"dsv4 engine: {exc}", file=sys.stderr)
        return 1
    log.info("engine ready: %s", info)
    try:
        app = build_app(engine, tokenizer, config.model_name, metrics)
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
    return 0
