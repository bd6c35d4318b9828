"""The operator's test-only ``--autoscaler-address-map``: which local process plays a kwok pod's
port; anything it does not name (or an unreadable file) has no address, so the read fails and
the tick holds, as with an unreachable pod."""

from __future__ import annotations

import json
from pathlib import Path

from dsv4_operator.autoscaling.loop import mapped_address


def test_a_named_pod_port_maps_and_everything_else_has_no_address(tmp_path: Path) -> None:
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"a-decode-0-0": {"8000": "127.0.0.1:4100"}}))
    pod = {"metadata": {"name": "a-decode-0-0"}}
    assert mapped_address(str(path), pod, 8000) == "127.0.0.1:4100"
    assert mapped_address(str(path), pod, 14581) is None
    assert mapped_address(str(path), {"metadata": {"name": "other"}}, 8000) is None
    assert mapped_address(str(path), None, 8000) is None
    path.write_text("{not json")
    assert mapped_address(str(path), pod, 8000) is None
    assert mapped_address(str(tmp_path / "missing.json"), pod, 8000) is None


def test_the_gateway_s_endpoint_host_stands_for_every_slice_address() -> None:
    from dsv4_serving.gateway.discovery import members_from_slices

    s = {
        "metadata": {"labels": {"serving.dsv4.io/role": "decode"}},
        "ports": [{"name": "http", "port": 4100}],
        "endpoints": [
            {"addresses": ["203.0.113.1"], "targetRef": {"name": "a-decode-0-0"}},
            {"addresses": ["203.0.113.1"], "targetRef": {"name": "a-decode-1-0"}},
        ],
    }
    assert members_from_slices([s], host="127.0.0.1")["decode"] == {"http://127.0.0.1:4100"}
    assert members_from_slices([s], frozenset({"a-decode-0"}))["decode"] == {
        "http://203.0.113.1:4100"
    }
