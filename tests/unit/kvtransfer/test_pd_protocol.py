from __future__ import annotations

import copy

import pytest

from dsv4_kvtransfer.pd_protocol import (
    KVParamsError,
    PrefillRequestParams,
    RemotePrefillParams,
    decode_request,
    parse_kv_transfer_params,
    prefill_overrides,
    prefill_request,
)

RESPONSE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-0",
    "remote_request_id": "cmpl-1",
    "remote_block_ids": [4, 5, 6],
    "remote_host": "10.0.0.7",
    "remote_port": 14579,
    "remote_transfer_id": "a1b2c3",
    "remote_lease_expires_at": 1700000030.5,
    "remote_num_tokens": 300,
    "remote_total_bytes": 123456,
    "remote_state_slot": 2,
    "remote_cache_groups": {"comp4": 3, "window": 1},
    "tp_size": 1,
    "kv_protocol": 1,
}


def test_prefill_request_params_are_vllms_exactly() -> None:
    assert PrefillRequestParams().to_dict() == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert isinstance(
        parse_kv_transfer_params(PrefillRequestParams().to_dict()), PrefillRequestParams
    )


def test_remote_prefill_params_round_trip_and_keep_unknown_fields() -> None:
    d = {**RESPONSE, "vendor_field": {"x": [1]}}
    p = parse_kv_transfer_params(d)
    assert isinstance(p, RemotePrefillParams)
    assert p.remote_block_ids == (4, 5, 6) and p.remote_state_slot == 2
    assert p.extra == {"vendor_field": {"x": [1]}}
    assert p.to_dict() == d


def test_plain_requests_have_no_params() -> None:
    assert parse_kv_transfer_params(None) is None
    assert parse_kv_transfer_params({}) is None
    assert parse_kv_transfer_params({"do_remote_decode": False, "do_remote_prefill": False}) is None


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"remote_port": "14579"}, "remote_port", "must be an integer"),
        ({"remote_port": 70000}, "remote_port", "[1, 65535]"),
        ({"remote_port": True}, "remote_port", "must be an integer"),
        ({"remote_block_ids": [1, -2]}, "remote_block_ids", "-2"),
        ({"remote_block_ids": "1,2"}, "remote_block_ids", "list"),
        ({"remote_host": ""}, "remote_host", "non-empty"),
        ({"remote_transfer_id": "../etc"}, "remote_transfer_id", "[A-Za-z0-9_-]"),
        ({"remote_lease_expires_at": "soon"}, "remote_lease_expires_at", "unix time"),
        ({"remote_cache_groups": {"x": -1}}, "remote_cache_groups", "'x'"),
        ({"kv_protocol": 2}, "kv_protocol", "not supported"),
        ({"do_remote_prefill": "yes"}, "do_remote_prefill", "true or false"),
        ({"remote_engine_id": None}, "remote_engine_id", "required"),
        ({"do_remote_decode": True}, "do_remote_prefill", "cannot both be true"),
    ],
)
def test_malformed_params_are_rejected_naming_the_field(
    change: dict[str, object], field: str, words: str
) -> None:
    d = {**copy.deepcopy(RESPONSE), **change}
    with pytest.raises(KVParamsError) as e:
        parse_kv_transfer_params(d)
    assert e.value.field == field
    assert str(e.value).startswith(f"kv_transfer_params.{field}")
    assert words in str(e.value)


def test_a_prefill_request_must_not_carry_remote_fields() -> None:
    with pytest.raises(KVParamsError, match="remote_host: must be null"):
        parse_kv_transfer_params({"do_remote_decode": True, "remote_host": "x"})
    with pytest.raises(KVParamsError, match="must be an object"):
        parse_kv_transfer_params([1])


def test_gateway_helpers_build_vllms_two_requests() -> None:
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 50,
    }
    pre = prefill_request(body)
    assert pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1
    assert pre["stream"] is False and "stream_options" not in pre
    assert pre["kv_transfer_params"] == PrefillRequestParams().to_dict()
    assert body["max_tokens"] == 50 and body["stream"] is True  # the original is untouched
    dec = decode_request(body, {"choices": [], "kv_transfer_params": RESPONSE})
    assert dec["kv_transfer_params"] == RESPONSE
    assert dec["max_tokens"] == 50 and dec["stream"] is True
    with pytest.raises(KVParamsError, match="no kv_transfer_params"):
        decode_request(body, {"choices": []})
    with pytest.raises(KVParamsError):
        decode_request(body, {"kv_transfer_params": PrefillRequestParams().to_dict()})


def test_a_prefill_for_a_remote_decode_makes_exactly_one_token() -> None:
    assert prefill_overrides({"max_tokens": 50}) == {"max_tokens": 1}
    assert prefill_overrides(
        {"max_tokens": None, "max_completion_tokens": 9, "min_tokens": 4, "stop": ["\n"]}
    ) == {"max_tokens": 1, "max_completion_tokens": 1, "min_tokens": 1, "stop": None}
    # absent or empty fields stay as they are
    assert prefill_overrides({"min_tokens": 0, "stop": []}) == {"max_tokens": 1}


def test_the_gateways_prefill_request_applies_the_one_token_rule() -> None:
    pre = prefill_request({"prompt": "hi", "max_tokens": 50, "min_tokens": 5, "stop": "x"})
    assert (pre["max_tokens"], pre["min_tokens"], pre["stop"]) == (1, 1, None)
