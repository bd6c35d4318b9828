"""One engine and its KV sidecar, wired to each other: the engine's ``--kv-sidecar`` is the
sidecar's control API, the sidecar's ``engine_url`` the engine. ``dsv4 up``, the dev cluster's
process nodes and the gateway tests build their prefill/decode instances here, not started (the
caller starts the sidecar first)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, TypeVar

from dsv4_common.process import Service, dsv4_argv, free_ports
from dsv4_kvtransfer.launch import SidecarService
from dsv4_serving.platform.share_exec import wrap
from dsv4_serving.platform.threads import ProcessShare

S = TypeVar("S", bound=Service)

TINY_ENGINE = (
    "--model",
    "dsv4-tiny",
    "--load-format",
    "dummy",
    "--dtype",
    "float32",
    "--seed",
    "0",
)
"""The built-in tiny model with random weights, float32, seeded: what the tests and the dev
cluster's process nodes serve."""
PORTS_PER_INSTANCE = 4
"""The engine's port, then the sidecar's peer, control and metrics ports (consecutive)."""


def in_share(service: S, share: ProcessShare) -> S:
    """``service`` run inside its CPU share (pinned, with the share's environment); an
    engine's thread flag comes with its arguments (``ProcessShare.engine_args``)."""
    service.argv = wrap(service.argv, share)
    return service


class PDInstance(NamedTuple):
    """In start order: the sidecar, then its engine."""

    sidecar: SidecarService
    engine: Service


def engine_service(
    name: str, model_args: Sequence[str], port: int, log_dir: Path, *extra: str
) -> Service:
    """``dsv4 engine`` on 127.0.0.1:``port`` (not started); ``extra`` comes last, so it can
    override what comes before."""
    argv = dsv4_argv("engine", *model_args, "--host", "127.0.0.1", "--port", str(port), *extra)
    return Service(name, argv, log_dir / f"{name}-{port}.log", f"http://127.0.0.1:{port}")


def engine_with_sidecar(
    name: str,
    role: str,
    model_args: Sequence[str],
    *,
    log_dir: Path,
    token_file: Path,
    taken: set[int],
    shm_prefix: str,
    engine_args: Sequence[str] = (),
    **sidecar_settings: object,
) -> PDInstance:
    """A ``role`` (prefill or decode) engine and its sidecar on ``PORTS_PER_INSTANCE`` free
    consecutive ports outside ``taken`` (which grows by them). ``sidecar_settings`` are
    ``SidecarConfig`` settings over the defaults (TCP, a 64 MiB staging region)."""
    port = free_ports(PORTS_PER_INSTANCE, taken)
    kv_port = port + 1
    settings: dict[str, object] = {"transport": "tcp", "staging_bytes": 64 << 20}
    sidecar = SidecarService(
        f"{name}-sidecar",
        log_dir / f"{name}-sidecar-{kv_port}.log",
        token_file,
        kv_port,
        engine_url=f"http://127.0.0.1:{port}",
        shm_name=f"{shm_prefix}-{name}-{kv_port}",
        **{**settings, **sidecar_settings},
    )
    engine = engine_service(
        name,
        model_args,
        port,
        log_dir,
        *("--role", role, "--kv-sidecar", f"http://127.0.0.1:{sidecar.control_port}"),
        *engine_args,
    )
    return PDInstance(sidecar, engine)
