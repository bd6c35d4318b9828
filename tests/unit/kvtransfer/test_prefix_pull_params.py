"""``PrefixPullParams``: where it goes in ``kv_transfer_params``, what it parses into, and the
field each refusal names."""

from __future__ import annotations

from typing import Any

import pytest

from dsv4_kvtransfer.pd_protocol import (
    PREFIX_PULL,
    KVParamsError,
    PrefillRequestParams,
    PrefixPullParams,
    RemotePrefillParams,
    parse_kv_transfer_params,
    prefix_pull_of,
    without_prefix_pull,
)

KEY = "ab" * 32
PULL = {"remote_host": "10.0.0.7", "remote_port": 14579, "num_tokens": 256, "prefix_key": KEY}


def test_an_ordinary_request_with_a_prefix_pull() -> None:
    got = parse_kv_transfer_params({PREFIX_PULL: PULL})
    assert got == PrefixPullParams("10.0.0.7", 14579, 256, KEY)
    assert isinstance(got, PrefixPullParams)
    assert got.transfer_id == KEY[:24] and got.to_dict() == PULL
    assert prefix_pull_of(got) is got and without_prefix_pull(got) is None


def test_a_prefill_request_with_a_prefix_pull_round_trips() -> None:
    body = {**PrefillRequestParams().to_dict(), PREFIX_PULL: PULL}
    got = parse_kv_transfer_params(body)
    assert isinstance(got, PrefillRequestParams)
    assert got.prefix_pull == PrefixPullParams("10.0.0.7", 14579, 256, KEY)
    assert got.to_dict() == body
    assert without_prefix_pull(got) == PrefillRequestParams()
    assert PREFIX_PULL not in PrefillRequestParams().to_dict()
    assert parse_kv_transfer_params({"do_remote_decode": False}) is None


@pytest.mark.parametrize(
    ("pull", "field", "message"),
    [
        ("x", PREFIX_PULL, "must be an object, got str"),
        ({**PULL, "remote_host": ""}, f"{PREFIX_PULL}.remote_host", "must be a non-empty"),
        ({**PULL, "remote_port": 0}, f"{PREFIX_PULL}.remote_port", "must be in [1, 65535]"),
        ({**PULL, "remote_port": "1"}, f"{PREFIX_PULL}.remote_port", "must be an integer"),
        ({**PULL, "num_tokens": 0}, f"{PREFIX_PULL}.num_tokens", "must be in [1,"),
        (
            {k: v for k, v in PULL.items() if k != "num_tokens"},
            f"{PREFIX_PULL}.num_tokens",
            "is required",
        ),
        ({**PULL, "prefix_key": "AB" * 32}, f"{PREFIX_PULL}.prefix_key", "64 lowercase hex"),
        ({**PULL, "prefix_key": "ab"}, f"{PREFIX_PULL}.prefix_key", "64 lowercase hex"),
        ({**PULL, "block_hashes": []}, f"{PREFIX_PULL}.block_hashes", "is not a field"),
    ],
)
def test_bad_prefix_pulls_name_their_field(pull: Any, field: str, message: str) -> None:
    for body in ({PREFIX_PULL: pull}, {**PrefillRequestParams().to_dict(), PREFIX_PULL: pull}):
        with pytest.raises(KVParamsError) as e:
            parse_kv_transfer_params(body)
        assert e.value.field == field and message in str(e.value)
        assert str(e.value).startswith(f"kv_transfer_params.{field}: ")


def test_a_decode_request_cannot_carry_a_prefix_pull() -> None:
    decode = RemotePrefillParams("p", "r", (), "h", 1, "t", 0.0, 1, 1).to_dict()
    with pytest.raises(KVParamsError) as e:
        parse_kv_transfer_params({**decode, PREFIX_PULL: PULL})
    assert e.value.field == PREFIX_PULL
