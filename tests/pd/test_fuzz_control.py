"""The KV sidecar's control API under generated requests (hypothesis), a real process: any body
on any route gets an answer below 500 in the OpenAI error shape, the sidecar stays up, and
once the short leases have run out its staging region is as free as it started."""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import wait_for
from tests.pd.sidecars import SidecarFactory
from tests.unit.kvtransfer.test_wire_properties import export_like, json_values

EXAMPLES = int(os.environ.get("DSV4_FUZZ_EXAMPLES", "150"))
ROUTES = [
    ("POST", "/v1/exports"),
    ("POST", "/v1/exports/{id}/commit"),
    ("GET", "/v1/exports/{id}"),
    ("DELETE", "/v1/exports/{id}"),
    ("POST", "/v1/pulls"),
    ("GET", "/v1/pulls/{id}"),
    ("DELETE", "/v1/pulls/{id}"),
    ("GET", "/v1/info"),
    ("GET", "/ready"),
    ("PUT", "/v1/exports"),
]
valid_export = st.builds(
    lambda rid, n: {
        "request_id": rid,
        "buffers": [{"name": "k", "dtype": "bfloat16", "shape": [n, 64], "group": "g"}],
        "lease_seconds": 1.0,
    },
    st.text(min_size=1, max_size=8),
    st.integers(0, 64),
)


def test_the_control_api_answers_any_request_without_a_5xx_or_a_leak(
    sidecars: SidecarFactory,
) -> None:
    sc = sidecars.start(lease=1.0, staging="16M")
    free = sc.free_bytes()
    ids: list[str] = ["nope"]
    client = httpx.Client(base_url=sc.url, timeout=10)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize="DSV4_FUZZ_SEED" not in os.environ,  # CI: the same examples every run
        suppress_health_check=list(HealthCheck),
    )
    @given(
        route=st.sampled_from(ROUTES),
        body=st.one_of(valid_export, export_like, json_values),
        pick=st.integers(0, 1000),
        query=st.sampled_from(["", "?wait=0.01", "?wait=-1", "?wait=nan", "?wait=x"]),
        raw=st.booleans(),
    )
    def one(route: tuple[str, str], body: Any, pick: int, query: str, raw: bool) -> None:
        method, path = route
        path = path.replace("{id}", ids[pick % len(ids)]) + (query if method == "GET" else "")
        content = json.dumps(body).encode() if not raw else json.dumps(body).encode()[:-1]
        r = client.request(method, path, content=content if method != "GET" else None)
        assert r.status_code < 500, (method, path, body, r.text)
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["message"] and err["code"], r.text
        elif method == "POST" and path == "/v1/exports":
            ids.append(r.json()["transfer_id"])

    one()
    assert sc.alive()
    wait_for("every lease to run out", lambda: sc.free_bytes() == free, 15, 0.1)
    client.close()
