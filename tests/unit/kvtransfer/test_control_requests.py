"""The control API's bodies: what parses into which typed request, and what is refused with a
400 that names the field."""

from __future__ import annotations

from typing import Any

import pytest

from dsv4_kvtransfer.buffers import BufferSpec, Layout
from dsv4_kvtransfer.control_requests import (
    MAX_BLOCK_IDS,
    MAX_WAIT_S,
    ExportRequest,
    PullRequest,
    parse_wait,
)
from dsv4_kvtransfer.errors import ApiError
from dsv4_kvtransfer.pd_protocol import RemotePrefillParams

BUF = {"name": "k", "dtype": "bfloat16", "shape": [2, 4], "group": "window"}


def params() -> dict[str, Any]:
    return RemotePrefillParams(
        remote_engine_id="e",
        remote_request_id="r",
        remote_block_ids=(1, 2),
        remote_host="10.0.0.1",
        remote_port=14579,
        remote_transfer_id="abc",
        remote_lease_expires_at=1e9,
        remote_num_tokens=20,
        remote_total_bytes=4096,
    ).to_dict()


def refused(parse: Any, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(body)
    assert e.value.status == 400
    return e.value


def test_an_export_body_parses_into_a_typed_request_with_its_layout_planned() -> None:
    req = ExportRequest.from_body(
        {
            "request_id": "r1",
            "buffers": [BUF],
            "block_ids": [3, 4],
            "num_tokens": 40,
            "state_slot": 0,
            "cache_groups": {"window": 1},
            "engine_meta": {"first_token": 7},
            "params_extra": {"kv_layout": "v4"},
            "lease_seconds": 5,
        }
    )
    assert req == ExportRequest(
        request_id="r1",
        layout=Layout.plan([BufferSpec("k", "bfloat16", (2, 4), "window")]),
        engine_id=None,
        block_ids=(3, 4),
        num_tokens=40,
        state_slot=0,
        cache_groups={"window": 1},
        engine_meta={"first_token": 7},
        params_extra={"kv_layout": "v4"},
        lease_seconds=5.0,
    )


def test_an_export_body_with_only_the_required_fields_takes_the_defaults() -> None:
    req = ExportRequest.from_body({"request_id": "r1", "buffers": [BUF]})
    assert (req.engine_id, req.block_ids, req.num_tokens, req.state_slot) == (None, (), 0, None)
    assert (req.cache_groups, req.engine_meta, req.params_extra) == ({}, {}, {})
    assert req.lease_seconds is None and req.layout.total_bytes == 2 * 4 * 2


@pytest.mark.parametrize(
    ("change", "param", "code", "message"),
    [
        ({"request_id": ""}, "request_id", "bad_request", "request_id must be a string of 1-256"),
        ({"request_id": 5}, "request_id", "bad_request", "request_id must be a string"),
        ({"buffers": "x"}, "buffers", "bad_request", "buffers must be a list of {name, dtype"),
        ({"buffers": [{"name": "x"}]}, "buffers", "bad_layout", "buffers: "),
        ({"buffers": [BUF, BUF]}, "buffers", "bad_layout", "buffers: "),
        ({"buffers": []}, "buffers", "bad_layout", "buffers: a transfer needs at least one"),
        ({"engine_id": ""}, "engine_id", "bad_request", "engine_id must be a string"),
        ({"block_ids": [1, -1]}, "block_ids", "bad_request", "block_ids must be a list of at"),
        ({"block_ids": [True]}, "block_ids", "bad_request", "block_ids must be"),
        ({"block_ids": [0] * (MAX_BLOCK_IDS + 1)}, "block_ids", "bad_request", "block_ids must"),
        ({"num_tokens": -1}, "num_tokens", "bad_request", "num_tokens must be an integer >= 0"),
        ({"state_slot": 1.5}, "state_slot", "bad_request", "state_slot must be an integer >= 0"),
        ({"cache_groups": {"w": -1}}, "cache_groups", "bad_request", "cache_groups must map"),
        ({"cache_groups": [1]}, "cache_groups", "bad_request", "cache_groups must be an object"),
        ({"engine_meta": "x"}, "engine_meta", "bad_request", "engine_meta must be an object"),
        ({"engine_meta": {"x": "y" * 20000}}, "engine_meta", "bad_request", "engine_meta is over"),
        (
            {"params_extra": {"remote_host": "evil", "remote_port": 1}},
            "params_extra",
            "bad_request",
            "params_extra must not set protocol fields (remote_host, remote_port)",
        ),
        ({"lease_seconds": 0}, "lease_seconds", "bad_request", "lease_seconds must be a number"),
        (
            {"lease_seconds": 3601},
            "lease_seconds",
            "bad_request",
            "lease_seconds must be a number of seconds in (0, 3600]",
        ),
        ({"lease_seconds": True}, "lease_seconds", "bad_request", "lease_seconds must be"),
    ],
)
def test_a_bad_export_body_is_refused_naming_the_field(
    change: dict[str, Any], param: str, code: str, message: str
) -> None:
    e = refused(ExportRequest.from_body, {"request_id": "r1", "buffers": [BUF], **change})
    assert (e.param, e.code) == (param, code)
    assert str(e).startswith(message)


def test_a_pull_body_parses_the_params_once_into_the_protocol_type() -> None:
    req = PullRequest.from_body({"kv_transfer_params": params(), "timeout_s": 12, "wait_s": 0.5})
    assert req == PullRequest(RemotePrefillParams.from_dict(params()), 12.0, 0.5)
    assert PullRequest.from_body({"kv_transfer_params": params()}).timeout_s is None


def test_bad_kv_transfer_params_are_refused_naming_the_params_field() -> None:
    e = refused(PullRequest.from_body, {"kv_transfer_params": {**params(), "remote_port": "x"}})
    assert (e.code, e.param) == ("bad_kv_transfer_params", "kv_transfer_params.remote_port")
    assert str(e).startswith("kv_transfer_params.remote_port: ")
    e = refused(PullRequest.from_body, {})
    assert e.param == "kv_transfer_params.do_remote_prefill"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": "5"}, "timeout_s"),
        ({"wait_s": -1}, "wait_s"),
    ],
)
def test_bad_pull_timings_are_refused_naming_the_field(change: dict[str, Any], param: str) -> None:
    e = refused(PullRequest.from_body, {"kv_transfer_params": params(), **change})
    assert (e.code, e.param) == ("bad_request", param)


def test_a_long_poll_wait_is_a_number_capped_at_the_limit() -> None:
    assert parse_wait(None) == 0.0
    assert parse_wait("2.5") == 2.5
    assert parse_wait(3) == 3.0
    assert parse_wait(1e9) == MAX_WAIT_S
    for bad in ("soon", "nan", -0.1, True):
        with pytest.raises(ApiError) as e:
            parse_wait(bad)
        assert (e.value.status, e.value.param) == (400, "wait")
