"""What a request must satisfy before it reaches the engine core, decided once, here, at the
API edge (the core only asserts it). Pure Python: no torch, no HTTP."""

from __future__ import annotations

from collections.abc import Sequence

from dsv4_kvtransfer.pd_protocol import (
    KVParamsError,
    PrefillRequestParams,
    PrefixPullParams,
    RemotePrefillParams,
    parse_kv_transfer_params,
)

KVParams = PrefillRequestParams | RemotePrefillParams | PrefixPullParams


class BadRequest(ValueError):
    """HTTP 400: ``code`` is the machine-readable reason, ``param`` the offending field."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str = "invalid_request"
    ) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def check_prompt(
    ids: Sequence[int], max_tokens: int, max_model_len: int, vocab_size: int, param: str
) -> None:
    """vLLM's rule: prompt + ``max_tokens`` must fit in ``max_model_len``. (The core itself
    needs only room for one output token, ``len(ids) < max_model_len``, which this implies as
    ``max_tokens >= 1``; refusing up front tells the client instead of cutting it short.)"""
    if not ids:
        raise BadRequest("the prompt is empty", param=param)
    if len(ids) + max_tokens > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} "
            "for the completion). Please reduce the length of the prompt or max_tokens.",
            param=param,
            code="context_length_exceeded",
        )
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"token ids out of range [0, {vocab_size}): {bad[:5]}", param=param)


def parse_kv_params(value: object, role: str, has_connector: bool) -> KVParams | None:
    """The request's typed ``kv_transfer_params`` (None for an ordinary request), or
    ``BadRequest`` saying why this engine cannot take them: ``prefill`` takes prefills for a
    remote decode, ``decode`` takes requests whose prompt KV was computed remotely, ``both``
    with a sidecar takes either; every role serves ordinary requests."""
    try:
        parsed = parse_kv_transfer_params(value)
    except KVParamsError as exc:
        raise BadRequest(
            str(exc), param="kv_transfer_params", code="invalid_kv_transfer_params"
        ) from exc
    if parsed is None:
        return None
    if not has_connector:
        why = (
            "kv_transfer_params: this engine has no KV connector (start it with --role "
            "prefill|decode|both and --kv-sidecar URL)"
        )
    elif isinstance(parsed, PrefillRequestParams) and role == "decode":
        why = (
            "kv_transfer_params.do_remote_decode: this is a decode engine; send prefills to a "
            "prefill (or both) engine"
        )
    elif isinstance(parsed, RemotePrefillParams) and role == "prefill":
        why = (
            "kv_transfer_params.do_remote_prefill: this is a prefill engine; send decodes to a "
            "decode (or both) engine"
        )
    else:
        return parsed
    raise BadRequest(why, param="kv_transfer_params", code="kv_role_mismatch")


DP_RANK_HEADER = "x-data-parallel-rank"  # vLLM's: the DP rank the gateway chose


def check_dp_rank(value: str | None, dp_size: int) -> int | None:
    """The DP rank the ``X-data-parallel-rank`` header pins the request to (None: unpinned;
    the engine routes it to the least-loaded rank)."""
    if value is None:
        return None
    try:
        rank = int(value)
    except ValueError:
        rank = -1
    if not 0 <= rank < dp_size:
        raise BadRequest(
            f"header {DP_RANK_HEADER}: {value!r} is not a data parallel rank of this engine "
            f"(0..{dp_size - 1})",
            code="invalid_data_parallel_rank",
        )
    return rank
