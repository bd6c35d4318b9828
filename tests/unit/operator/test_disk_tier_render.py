"""spec.kvCache.diskBytes: every KV sidecar gets ``--kv-disk-bytes`` (in bytes) and
``--kv-disk-dir`` on an emptyDir volume only it mounts, sized the cap plus the host tier plus
64Mi; off (0) by default: no flag, no volume. The sidecar's own parser and config take what is
rendered."""

from __future__ import annotations

from typing import Any

import pytest

from dsv4_common.cli import build_parser
from dsv4_common.config_cli import config_from_args
from dsv4_kvtransfer.config import SidecarConfig
from dsv4_operator.api.spec import parse
from dsv4_operator.reconcile import Facts, desired_children
from dsv4_operator.reconcile.kv_disk import KV_DISK_DIR
from tests.unit.operator.conftest import make_cr
from tests.unit.operator.test_host_tier_render import CPU

pytestmark = pytest.mark.unit


def _pods(**spec: Any) -> list[dict[str, Any]]:
    children = desired_children(parse(make_cr(**spec)), Facts(kv_token="t"))
    return [o["spec"]["template"]["spec"] for o in children if o["kind"] == "StatefulSet"]


def _sidecar(pod: dict[str, Any]) -> dict[str, Any]:
    (c,) = [c for c in pod["containers"] if c["command"][:2] == ["dsv4", "kv-sidecar"]]
    return c


def test_every_sidecar_gets_the_disk_tier_and_its_volume() -> None:
    pods = _pods(**CPU, kvCache={"hostBytes": "512Mi", "diskBytes": "20Gi"})
    assert len(pods) == 2
    for pod in pods:
        argv = _sidecar(pod)["command"]
        args = build_parser(argv[1]).parse_args(argv[1:])  # the sidecar's own parser
        assert (int(args.kv_disk_bytes), args.kv_disk_dir) == (20 << 30, KV_DISK_DIR)
        cfg = config_from_args(SidecarConfig, args, token=b"t" * 16)
        assert (cfg.kv_disk_bytes, cfg.kv_host_bytes) == (20 << 30, 512 << 20)
        (vol,) = [v for v in pod["volumes"] if v["name"] == "kv-disk"]
        assert vol == {"name": "kv-disk", "emptyDir": {"sizeLimit": str((20 << 30) + (576 << 20))}}
        assert pod["volumes"][-1] is vol and pod["volumes"][0]["name"] == "shm"
        assert {"name": "kv-disk", "mountPath": KV_DISK_DIR} in _sidecar(pod)["volumeMounts"]
        engine = next(c for c in pod["containers"] if c["name"] == "engine")
        assert all(m["name"] != "kv-disk" for m in engine["volumeMounts"])


def test_the_disk_tier_is_off_by_default() -> None:
    for pod in _pods(**CPU, kvCache={"hostBytes": "512Mi"}):
        assert "--kv-disk-bytes" not in _sidecar(pod)["command"]
        assert all(v["name"] != "kv-disk" for v in pod["volumes"])
