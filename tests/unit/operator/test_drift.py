"""Whether a live child already holds what would be applied: hash annotation plus field check."""

from __future__ import annotations

import copy
from typing import Any

from dsv4_operator.drift import covers, desired_hash, stamp, up_to_date
from dsv4_operator.reconcile.names import DESIRED_HASH_ANNOTATION

DESIRED: dict[str, Any] = {
    "apiVersion": "apps/v1",
    "kind": "StatefulSet",
    "metadata": {"name": "v4-decode-0", "namespace": "ml", "labels": {"a": "b"}},
    "spec": {
        "replicas": 1,
        "template": {
            "spec": {
                "containers": [
                    {
                        "name": "engine",
                        "env": [],
                        "ports": [{"name": "http", "containerPort": 8000}],
                        "resources": {"requests": {"cpu": 1}},
                        "volumeMounts": [{"name": "m", "mountPath": "/m", "subPath": ""}],
                    }
                ],
                "securityContext": {},
            }
        },
    },
}


def _as_stored(stamped: dict[str, Any]) -> dict[str, Any]:
    """What a LIST returns after the API server stored ``stamped``: no type meta, defaults
    added, empty values and quantities normalised, a status."""
    live = copy.deepcopy(stamped)
    del live["apiVersion"], live["kind"]
    live["metadata"]["resourceVersion"] = "7"
    live["spec"]["podManagementPolicy"] = "OrderedReady"
    c = live["spec"]["template"]["spec"]["containers"][0]
    del c["env"]
    c["ports"][0]["protocol"] = "TCP"
    c["resources"]["requests"]["cpu"] = "1"
    del c["volumeMounts"][0]["subPath"]
    live["status"] = {"replicas": 1}
    return live


def test_stamp_records_the_hash_of_the_unstamped_object() -> None:
    stamped = stamp(DESIRED)
    assert stamped["metadata"]["annotations"] == {DESIRED_HASH_ANNOTATION: desired_hash(DESIRED)}
    assert "annotations" not in DESIRED["metadata"]
    assert desired_hash(DESIRED) == desired_hash(copy.deepcopy(DESIRED))


def test_what_the_api_server_adds_or_normalises_is_not_a_difference() -> None:
    stamped = stamp(DESIRED)
    assert up_to_date(stamped, _as_stored(stamped))


def test_a_hand_edit_of_an_applied_field_is_a_difference() -> None:
    stamped = stamp(DESIRED)
    live = _as_stored(stamped)
    live["spec"]["replicas"] = 3
    assert not up_to_date(stamped, live)


def test_a_changed_desired_object_is_a_difference_even_when_live_still_covers_it() -> None:
    old = stamp(DESIRED)
    live = _as_stored(old)
    smaller = copy.deepcopy(DESIRED)
    del smaller["metadata"]["labels"]  # only a new apply removes a field we stopped setting
    assert covers(live, {k: v for k, v in smaller.items() if k not in ("apiVersion", "kind")})
    assert not up_to_date(stamp(smaller), live)


def test_lists_match_item_by_item() -> None:
    assert covers([{"a": 1, "b": 2}], [{"a": 1}])
    assert not covers([{"a": 1}, {"a": 2}], [{"a": 1}])
    assert not covers([{"a": 2}], [{"a": 1}])
    assert covers(None, [])
    assert not covers(None, [{"a": 1}])


def test_booleans_and_numbers_are_not_confused() -> None:
    assert not covers(1, True)
    assert not covers(0, False)
    assert covers(False, False)
    assert covers("8", 8) and not covers("80", 8)


def test_a_false_bool_the_api_server_omits_is_not_a_difference() -> None:
    # a Service's publishNotReadyAddresses: false comes back absent (omitempty)
    assert covers({"spec": {"clusterIP": "None"}}, {"spec": {"publishNotReadyAddresses": False}})
    assert not covers(
        {"spec": {"publishNotReadyAddresses": True}}, {"spec": {"publishNotReadyAddresses": False}}
    )
