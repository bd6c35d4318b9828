"""The pod's /dev/shm budget: the sidecar's staging region is shmSize minus the engine's share."""

from __future__ import annotations

import pytest

from dsv4_operator.reconcile.errors import ReconcileError
from dsv4_operator.reconcile.shm import (
    ENGINE_SHM_RESERVE,
    host_tier_bytes,
    quantity_bytes,
    staging_bytes,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1Gi", 1 << 30),
        ("512Mi", 512 << 20),
        ("64Gi", 64 << 30),
        ("1G", 10**9),
        ("1500M", 1_500_000_000),
        ("1e9", 10**9),
        ("1.5Gi", 3 << 29),
        ("123", 123),
    ],
)
def test_quantities_in_bytes(text: str, expected: int) -> None:
    assert quantity_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "Gi", "1GB", "one", "-1Gi", "1 Gi"])
def test_what_is_not_a_quantity_is_named(text: str) -> None:
    with pytest.raises(ReconcileError, match="is not a Kubernetes quantity"):
        quantity_bytes(text)


def test_staging_is_the_volume_less_the_engines_share() -> None:
    assert ENGINE_SHM_RESERVE == 256 << 20
    assert staging_bytes("prefill", "1Gi") == 768 << 20
    assert staging_bytes("decode", "320Mi") == 64 << 20


def test_a_volume_too_small_for_both_is_refused_with_the_minimum() -> None:
    with pytest.raises(ReconcileError, match=r"decode\.shmSize 256Mi .* at least 320Mi"):
        staging_bytes("decode", "256Mi")


def test_the_host_tier_is_rendered_in_bytes_within_the_staging_region() -> None:
    assert host_tier_bytes("decode", "0", "1Gi") == 0
    assert host_tier_bytes("decode", "512Mi", "1Gi") == 512 << 20
    assert host_tier_bytes("prefill", "768Mi", "1Gi") == 768 << 20  # all of the staging region
    with pytest.raises(ReconcileError, match=r"kvCache\.hostBytes 1Gi exceeds the decode"):
        host_tier_bytes("decode", "1Gi", "1Gi")
