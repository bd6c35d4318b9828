"""spec.kvCache.hostBytes: every KV sidecar gets it as ``--kv-host-bytes`` (a flag its own
command line takes, in bytes); off (0) by default; more than the staging region is refused."""

from __future__ import annotations

from typing import Any

import pytest

from dsv4_common.cli import build_parser
from dsv4_kvtransfer.config import SidecarConfig
from dsv4_operator.api.spec import parse
from dsv4_operator.reconcile import Facts, desired_children
from dsv4_operator.reconcile.errors import ReconcileError
from tests.unit.operator.conftest import make_cr

pytestmark = pytest.mark.unit

CPU = {
    "model": {"preset": "dsv4-tiny", "servedName": "tiny"},
    "prefill": {"npusPerNode": 0, "parallelism": {"tp": 1}, "shmSize": "1Gi"},
    "decode": {"npusPerNode": 0, "parallelism": {"tp": 1}, "shmSize": "2Gi"},
    "kvTransfer": {"transport": "tcp"},
}


def _sidecars(**spec: Any) -> list[list[str]]:
    children = desired_children(parse(make_cr(**spec)), Facts(kv_token="t"))
    return [
        c["command"]
        for obj in children
        if obj["kind"] == "StatefulSet"
        for c in obj["spec"]["template"]["spec"]["containers"]
        if c["command"][:2] == ["dsv4", "kv-sidecar"]
    ]


def _host_bytes(argv: list[str]) -> int:
    args = build_parser(argv[1]).parse_args(argv[1:])  # the sidecar's own parser takes it
    return int(args.kv_host_bytes)


def test_every_sidecar_gets_the_host_tier_in_bytes() -> None:
    commands = _sidecars(**CPU, kvCache={"hostBytes": "512Mi"})
    assert len(commands) == 2
    assert [_host_bytes(c) for c in commands] == [512 << 20, 512 << 20]
    assert SidecarConfig(token=b"t", staging_bytes=768 << 20, kv_host_bytes=512 << 20)


def test_the_host_tier_is_off_by_default() -> None:
    assert [_host_bytes(c) for c in _sidecars(**CPU)] == [0, 0]


def test_a_host_tier_larger_than_a_staging_region_is_refused() -> None:
    # prefill's staging region: 1Gi - 256Mi = 768Mi
    with pytest.raises(ReconcileError, match=r"kvCache\.hostBytes 1Gi exceeds the prefill"):
        _sidecars(**CPU, kvCache={"hostBytes": "1Gi"})
