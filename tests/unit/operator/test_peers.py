"""Which peering entries a starting replica drops (``dsv4_operator/peers.py``): pure."""

from __future__ import annotations

import zlib

import pytest

from dsv4_operator.peers import dead_peers, replica_priority

pytestmark = pytest.mark.unit


def test_only_entries_of_pods_that_are_gone_and_never_its_own() -> None:
    status = {
        "op-a": {"priority": 0},  # its pod is gone
        "op-b": {"priority": 0},  # its pod runs
        "op-c": {"priority": 0},  # this replica
        "root@devbox/20261205": {"priority": 0},  # kopf's out-of-cluster id: no pod name
        "Op-D": {"priority": 0},  # upper case: no pod name either
    }
    alive = {"op-b", "op-c"}
    asked: list[str] = []

    def exists(pod: str) -> bool:
        asked.append(pod)
        return pod in alive

    assert dead_peers(status, "op-c", exists) == ["op-a"]
    assert sorted(asked) == ["op-a", "op-b"]  # nobody asks after ids that cannot be pods


def test_an_empty_or_missing_status_drops_nothing() -> None:
    assert dead_peers(None, "op", lambda _p: False) == []
    assert dead_peers({}, "op", lambda _p: False) == []


def test_a_pods_priority_comes_from_its_name_unless_given() -> None:
    assert replica_priority(7, "op-a") == 7
    assert replica_priority(0, "op-a") == 0
    assert replica_priority(None, None) == 0
    a, b = replica_priority(None, "dsv4-7d9c-abcde"), replica_priority(None, "dsv4-7d9c-fghij")
    assert a == replica_priority(None, "dsv4-7d9c-abcde")  # stable for the pod
    assert a != b and a > 0 and b > 0  # the chart's two replicas: one runs, one stands by
    assert a == 1 + (zlib.crc32(b"dsv4-7d9c-abcde") & 0x3FFFFFFF)
