"""spec.observability.tracing.otlpEndpoint on a real API server: a URL is accepted (and the
operator reads it back), anything else is refused with the field named."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dsv4_operator.api.spec import parse
from tests.k8s.test_crd_validation import _apply, _cr

ENDPOINT = "http://otel-collector.observability:4318"


def test_an_otlp_url_is_accepted(k8s_control_plane, dsv4_crd) -> None:  # type: ignore[no-untyped-def]
    cr = _cr(observability={"tracing": {"otlpEndpoint": ENDPOINT}})
    res = _apply(k8s_control_plane, copy.deepcopy(cr))
    assert res.returncode == 0, res.stderr
    assert parse(cr).observability.tracing.otlp_endpoint == ENDPOINT
    assert parse(_cr()).observability.tracing.otlp_endpoint is None  # off by default


@pytest.mark.parametrize("bad", ["otel-collector:4318", "grpc://c:4317", "http://c 4318", ""])
def test_anything_else_is_refused(k8s_control_plane, dsv4_crd, bad: str) -> None:  # type: ignore[no-untyped-def]
    obj: dict[str, Any] = _cr(observability={"tracing": {"otlpEndpoint": bad}})
    res = _apply(k8s_control_plane, obj)
    assert res.returncode != 0, f"{bad!r} accepted"
    assert "spec.observability.tracing.otlpEndpoint" in res.stderr, res.stderr
