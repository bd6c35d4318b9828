"""Which PD requests an engine takes, by role (pure Python; the front end and the core both
check). ``prefill`` takes prefills for a remote decode, ``decode`` takes requests whose prompt
KV was computed remotely, ``both`` with a sidecar takes either; every role also serves plain
requests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsv4_kvtransfer.pd_protocol import (
    PrefillRequestParams,
    RemotePrefillParams,
    parse_kv_transfer_params,
)


def check_kv_request(
    role: str, has_connector: bool, params: Mapping[str, Any] | None
) -> PrefillRequestParams | RemotePrefillParams | None:
    """The parsed params, or ``ValueError`` (``KVParamsError`` names the field) saying why
    this engine cannot take them."""
    parsed = parse_kv_transfer_params(params)
    if parsed is None:
        return None
    if not has_connector:
        raise ValueError(
            "kv_transfer_params: this engine has no KV connector (start it with --role "
            "prefill|decode|both and --kv-sidecar URL)"
        )
    if isinstance(parsed, PrefillRequestParams) and role == "decode":
        raise ValueError(
            "kv_transfer_params.do_remote_decode: this is a decode engine; send prefills to a "
            "prefill (or both) engine"
        )
    if isinstance(parsed, RemotePrefillParams) and role == "prefill":
        raise ValueError(
            "kv_transfer_params.do_remote_prefill: this is a prefill engine; send decodes to a "
            "decode (or both) engine"
        )
    return parsed
