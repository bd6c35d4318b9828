"""The API edge's checks, decided once before a request reaches the core: the context-length
rule, token ids, and which PD requests each role takes (exact codes and fields)."""

from __future__ import annotations

import pytest

from dsv4_kvtransfer.pd_protocol import PrefillRequestParams, RemotePrefillParams
from dsv4_serving.entrypoints.checks import (
    BadRequest,
    check_dp_rank,
    check_prompt,
    parse_kv_params,
)

REMOTE = {
    "do_remote_prefill": True,
    "remote_engine_id": "p",
    "remote_request_id": "r",
    "remote_block_ids": [1],
    "remote_host": "10.0.0.1",
    "remote_port": 14579,
    "remote_transfer_id": "t1",
    "remote_lease_expires_at": 1.0,
    "remote_num_tokens": 5,
    "remote_total_bytes": 10,
}


def test_prompt_plus_max_tokens_may_fill_the_context_exactly() -> None:
    check_prompt([1, 2, 3], 5, max_model_len=8, vocab_size=10, param="prompt")


def test_prompt_plus_max_tokens_past_the_context_is_refused() -> None:
    with pytest.raises(BadRequest) as e:
        check_prompt([1, 2, 3], 6, max_model_len=8, vocab_size=10, param="messages")
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "messages")
    assert "you requested 9 tokens (3 in the prompt, 6 for the completion)" in str(e.value)


def test_an_empty_prompt_and_out_of_vocabulary_ids_are_refused() -> None:
    with pytest.raises(BadRequest, match="the prompt is empty"):
        check_prompt([], 1, max_model_len=8, vocab_size=10, param="prompt")
    with pytest.raises(BadRequest, match=r"out of range \[0, 10\): \[10, -1\]"):
        check_prompt([1, 10, -1], 1, max_model_len=8, vocab_size=10, param="prompt")


def test_ordinary_requests_pass_on_every_engine() -> None:
    assert parse_kv_params(None, "decode", has_connector=False) is None
    assert parse_kv_params({"do_remote_decode": False}, "prefill", has_connector=True) is None


def test_pd_params_come_back_typed_where_the_role_takes_them() -> None:
    pre = PrefillRequestParams().to_dict()
    assert parse_kv_params(pre, "prefill", has_connector=True) == PrefillRequestParams()
    assert parse_kv_params(pre, "both", has_connector=True) == PrefillRequestParams()
    got = parse_kv_params(REMOTE, "decode", has_connector=True)
    assert isinstance(got, RemotePrefillParams) and got.remote_transfer_id == "t1"


@pytest.mark.parametrize(
    ("params", "role", "connector", "code", "words"),
    [
        ({"do_remote_decode": True}, "decode", True, "kv_role_mismatch", "this is a decode engine"),
        (REMOTE, "prefill", True, "kv_role_mismatch", "this is a prefill engine"),
        (REMOTE, "both", False, "kv_role_mismatch", "no KV connector"),
        ({**REMOTE, "remote_port": 0}, "decode", True, "invalid_kv_transfer_params", "[1, 65535]"),
    ],
)
def test_pd_params_an_engine_cannot_take_are_a_400_on_kv_transfer_params(
    params: dict[str, object], role: str, connector: bool, code: str, words: str
) -> None:
    with pytest.raises(BadRequest) as e:
        parse_kv_params(params, role, has_connector=connector)
    assert (e.value.code, e.value.param) == (code, "kv_transfer_params")
    assert words in str(e.value)


def test_the_dp_rank_header_pins_a_rank_of_this_engine_or_is_refused() -> None:
    assert check_dp_rank(None, 2) is None
    assert check_dp_rank("1", 2) == 1
    for bad in ("2", "-1", "x"):
        with pytest.raises(BadRequest) as e:
            check_dp_rank(bad, 2)
        assert e.value.code == "invalid_data_parallel_rank"
        assert str(e.value) == (
            f"header x-data-parallel-rank: {bad!r} is not a data parallel rank of this engine "
            "(0..1)"
        )
