"""``dsv4 engine``: serve one model over the OpenAI API.

Every engine setting is an ``EngineConfig`` field: a flag named after it (``--max-num-seqs``,
with the field's type, choices, default and docstring as help), or a key of ``--config FILE``,
a flat JSON object of field names (``{"dtype": "bfloat16", "max_model_len": 8192}``; unknown
keys are an error), which is what the operator writes as engine.json. Flags win over the file.
``--host``, ``--port`` and ``--log-level`` are the HTTP server's. Torch is imported only by the
engine-core process.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from dsv4_common.config_cli import add_config_arguments, given
from dsv4_serving.distributed.placement import Placement, PlacementError
from dsv4_serving.engine.config import ConfigError, EngineConfig

log = logging.getLogger("dsv4.engine")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        help="JSON object of engine config fields, e.g. the operator's engine.json (flags win)",
    )
    seconds = "SECONDS"
    add_config_arguments(
        p,
        EngineConfig,
        metavars={
            "kv_sidecar": "URL",
            "kv_events_endpoint": "URL",
            "kv_pull_timeout": seconds,
            "kv_sidecar_wait": seconds,
        },
    )
    # the spellings these switches had before the flags came from EngineConfig
    for flag, dest in (
        ("--no-prefix-caching", "enable_prefix_caching"),
        ("--no-chunked-prefill", "enable_chunked_prefill"),
    ):
        p.add_argument(
            flag,
            dest=dest,
            action="store_false",
            default=argparse.SUPPRESS,
            help=f"same as --no-{dest.replace('_', '-')}",
        )
    p.add_argument(
        "-cp",
        dest="context_parallel_size",
        type=int,
        default=argparse.SUPPRESS,
        help="same as --context-parallel-size",
    )
    add_node_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to serve on")
    p.add_argument("--port", type=int, default=8000, help="port to serve on")
    p.add_argument("--log-level", default="INFO", help="DEBUG | INFO | WARNING | ERROR")


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    """Where this process sits in a multi-node instance (``distributed/placement.py``);
    each defaults to the environment the operator renders."""
    g = p.add_argument_group("multi-node instances")
    g.add_argument(
        "--headless",
        action="store_true",
        help="run this node's ranks only (/health and /metrics, no API); what node rank > 0 "
        "does anyway, refused on node 0",
    )
    g.add_argument("--nnodes", type=int, help="nodes of the instance [env DSV4_NODES_PER_INSTANCE]")
    g.add_argument("--node-rank", type=int, help="this node's index [env DSV4_NODE_RANK]")
    g.add_argument("--master-addr", help="node 0's address [env DSV4_MASTER_ADDR]")
    g.add_argument(
        "--master-port",
        type=int,
        help="node 0's rendezvous port [env DSV4_MASTER_PORT; 29550 with several nodes, else a "
        "free local port]",
    )


def placement_of(args: argparse.Namespace) -> Placement:
    """The flags over the environment; a node rank > 0 is headless, ``--headless`` on node 0
    is refused."""
    placement = Placement.resolve(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
    )
    if args.headless and not placement.headless:
        raise PlacementError(
            "--headless runs the ranks of a node rank > 0, and this is node 0 (set --node-rank "
            "or DSV4_NODE_RANK)"
        )
    return placement


def build_config(args: argparse.Namespace) -> EngineConfig:
    """``--config FILE``'s fields, then the flags given; ``EngineConfig`` validates."""
    values = json.loads(Path(args.config).read_text()) if args.config else {}
    if not isinstance(values, dict):
        raise ConfigError(f"{args.config} must hold a JSON object of engine config fields")
    values.update(given(EngineConfig, args))
    return EngineConfig.from_dict(values)


def check_cp_model(model: str) -> None:
    """``--context-parallel-size`` needs a model with a CP forward (V4, V3's MLA): refused
    here, before any rank starts."""
    from dsv4_serving.models.config import architecture_of, read_config_json
    from dsv4_serving.presets.configs import PRESETS, preset_config

    try:
        arch = architecture_of(
            preset_config(model) if model in PRESETS else read_config_json(model)
        )
    except ValueError as exc:
        raise ConfigError(f"{model}: {exc}") from None
    if arch not in ("DeepseekV4ForCausalLM", "DeepseekV3ForCausalLM"):
        raise ConfigError(
            f"--context-parallel-size needs a DeepSeek V4 or V3 model; {model} is {arch}"
        )


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
        if config.context_parallel_size > 1:
            check_cp_model(config.model)
        placement = placement_of(args)
        config.topology(placement.nnodes)  # the world splits over the nodes
        if config.device == "cpu":
            config.check_parallel("cpu")
        if config.rank_table and not Path(config.rank_table).is_file():
            raise ConfigError(f"rank table {config.rank_table} does not exist")
        if config.kv_sidecar:
            check_sidecar(config.kv_sidecar, config.kv_sidecar_wait)
    except (ConfigError, PlacementError, OSError, json.JSONDecodeError, TypeError) as exc:
        print(f"dsv4 engine: {exc}", file=sys.stderr)
        return 2
    if placement.headless:
        from dsv4_serving.engine.worker.headless import serve_headless

        return serve_headless(config, placement, args.host, args.port)
    return serve(config, args.host, args.port, placement)


def serve(config: EngineConfig, host: str, port: int, placement: Placement | None = None) -> int:
    from dsv4_serving.engine.engine.async_llm import AsyncLLM, EngineDeadError
    from dsv4_serving.engine.engine.tokenizer import load_tokenizer
    from dsv4_serving.entrypoints.metrics import EngineMetrics

    try:
        tokenizer = load_tokenizer(config.model)
    except (OSError, ValueError) as exc:
        print(f"dsv4 engine: {exc}", file=sys.stderr)
        return 1
    metrics = EngineMetrics(config.model_name)
    if config.emulate_step_time is not None:
        from dsv4_serving.engine.emulated.runner import register_metric
        from dsv4_serving.engine.emulated.step_time import StepTime

        register_metric(metrics.registry, StepTime.parse(config.emulate_step_time))
    engine = AsyncLLM(config, tokenizer, metrics)
    # the core first: the front end's own imports (FastAPI, ~0.5 s) run while the core imports
    # torch (~3 s), instead of before it (a new instance's cold start, which autoscaling waits on)
    engine.launch(placement)
    import uvicorn

    from dsv4_serving.entrypoints.api_server import build_app

    try:
        info = engine.wait_ready()
    except EngineDeadError as exc:
        print(f"dsv4 engine: {exc}", file=sys.stderr)
        return 1
    log.info("engine ready: %s", info)
    app = build_app(engine, tokenizer, config.model_name, metrics)
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    )

    def dead(reason: str) -> None:
        # in-flight requests have their 503s; the graceful shutdown lets them go out
        log.error("engine core died (%s): the server stops", reason)
        server.should_exit = True

    engine.on_dead = dead
    try:
        server.run()
    finally:
        engine.shutdown()
    if engine.dead_reason is not None:
        print(f"dsv4 engine: {engine.dead_reason}", file=sys.stderr)
        return 1
    return 0
