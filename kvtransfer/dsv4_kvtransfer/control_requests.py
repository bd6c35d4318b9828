"""The control API's request bodies, parsed once into frozen dataclasses.

Each ``from_body`` is strict: a missing, mistyped or out-of-range field raises
``ApiError(400, code, message)`` whose message and ``param`` name the field, so the engine's log
says what to fix. What passes is typed; nothing past this module looks into the raw JSON.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dsv4_kvtransfer.buffers import BufferSpec, Layout, LayoutError
from dsv4_kvtransfer.errors import ApiError
from dsv4_kvtransfer.integrity import Fingerprint
from dsv4_kvtransfer.pd_protocol import KVParamsError, RemotePrefillParams

# the manifest (layout + engine meta) travels in one frame header; keep it well under the limit
MAX_MANIFEST_JSON = 512 << 10
MAX_ENGINE_META_JSON = 16 << 10
# block ids travel in the manifest too (a 1M-token prompt in 64-token blocks is 16K ids)
MAX_BLOCK_IDS = 65536
MAX_ID_CHARS = 256
MAX_LEASE_S = 3600.0
MAX_WAIT_S = 60.0

# the fast control socket's framing (``control.FastControlServer``, ``client.SidecarClient``):
# a request is FAST_REQUEST (the length of what follows) + b"METHOD TARGET[ TRACEPARENT]\n" +
# the body; an answer FAST_REPLY (status, body length) + the body
FAST_REQUEST = struct.Struct("!I")
FAST_REPLY = struct.Struct("!HI")
FAST_MAX_LINE = 1024
# the largest extent a sidecar grants an engine's client to copy a same-host pull into (a
# larger pull's fixed cost is a few percent of its copy: the sidecar makes it)
MAX_GRANT_BYTES = 64 << 20


def _bad(field: str, message: str, code: str = "bad_request") -> ApiError:
    return ApiError(400, code, f"{field} {message}", param=field)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _name(body: Mapping[str, Any], key: str, default: str | None = None) -> str:
    v = body.get(key, default)
    if not isinstance(v, str) or not 0 < len(v) <= MAX_ID_CHARS:
        raise _bad(key, f"must be a string of 1-{MAX_ID_CHARS} characters")
    return v


def _count(body: Mapping[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v) or v < 0:
        raise _bad(key, "must be an integer >= 0")
    return int(v)


def _seconds(body: Mapping[str, Any], key: str, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_number(v) or not 0 < v <= hi:
        raise _bad(key, f"must be a number of seconds in (0, {hi:g}]")
    return float(v)


def _fingerprint(body: Mapping[str, Any]) -> Fingerprint | None:
    v = body.get("fingerprint")
    if v is None:
        return None
    try:
        return Fingerprint.from_dict(v)
    except (ValueError, TypeError) as e:
        raise _bad(
            "fingerprint", f"is not a KV layout fingerprint: {e}", "bad_fingerprint"
        ) from None


def _object(body: Mapping[str, Any], key: str, max_json: int) -> dict[str, Any]:
    v = body.get(key) or {}
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise _bad(key, "must be an object")
    if len(json.dumps(v)) > max_json:
        raise _bad(key, f"is over {max_json} bytes as JSON")
    return v


_PREFIX_KEY = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class ExportRequest:
    """``POST /v1/exports``: reserve an extent for one request's KV buffers."""

    request_id: str
    layout: Layout
    """Where each buffer goes in the extent (planned from the body's ``buffers``)."""
    engine_id: str | None = None
    """``remote_engine_id`` in the params (None: the sidecar's ``engine_id``)."""
    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    state_slot: int | None = None
    cache_groups: Mapping[str, int] = field(default_factory=dict)
    engine_meta: Mapping[str, Any] = field(default_factory=dict)
    """Travels with the manifest to the decode side (``remote_meta``)."""
    params_extra: Mapping[str, Any] = field(default_factory=dict)
    """Fields added to the ``kv_transfer_params`` (what the decode side checks before it pulls);
    never one of the protocol's own fields."""
    lease_seconds: float | None = None
    """The export's lease (None: the sidecar's ``lease_seconds``)."""
    fingerprint: Fingerprint | None = None
    """The writer's KV layout (``integrity``), carried in the manifest for pullers to check."""
    prefix_key: str | None = None
    """An offer to the host tier: the prefix's key (64 hex digits, ``PrefixPullParams``); the
    export is kept under ``prefix_transfer_id(prefix_key)`` until evicted."""

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ExportRequest:
        request_id = _name(body, "request_id")
        raw = body.get("buffers")
        if not isinstance(raw, list):
            raise _bad("buffers", "must be a list of {name, dtype, shape}")
        try:
            layout = Layout.plan(BufferSpec.from_dict(b) for b in raw)
        except LayoutError as e:
            raise ApiError(400, "bad_layout", f"buffers: {e}", param="buffers") from None
        if len(json.dumps(layout.to_dict())) > MAX_MANIFEST_JSON:
            raise _bad("buffers", "is too long for one manifest", "bad_layout")
        engine_id = _name(body, "engine_id") if body.get("engine_id") is not None else None
        block_ids = body.get("block_ids") or []
        if (
            not isinstance(block_ids, list)
            or len(block_ids) > MAX_BLOCK_IDS
            or not all(_is_int(b) and b >= 0 for b in block_ids)
        ):
            raise _bad("block_ids", f"must be a list of at most {MAX_BLOCK_IDS} integers >= 0")
        groups = _object(body, "cache_groups", MAX_ENGINE_META_JSON)
        if not all(_is_int(v) and v >= 0 for v in groups.values()):
            raise _bad("cache_groups", "must map group names to counts >= 0")
        extra = _object(body, "params_extra", MAX_ENGINE_META_JSON)
        clash = sorted(k for k in extra if k in RemotePrefillParams.KNOWN)
        if clash:
            raise _bad("params_extra", f"must not set protocol fields ({', '.join(clash)})")
        return cls(
            request_id=request_id,
            layout=layout,
            engine_id=engine_id,
            block_ids=tuple(block_ids),
            num_tokens=_count(body, "num_tokens") or 0,
            state_slot=_count(body, "state_slot"),
            cache_groups=groups,
            engine_meta=_object(body, "engine_meta", MAX_ENGINE_META_JSON),
            params_extra=extra,
            lease_seconds=_seconds(body, "lease_seconds", MAX_LEASE_S),
            fingerprint=_fingerprint(body),
            prefix_key=_prefix_key(body),
        )


def _prefix_key(body: Mapping[str, Any]) -> str | None:
    v = body.get("prefix_key")
    if v is None:
        return None
    if not isinstance(v, str) or not _PREFIX_KEY.match(v):
        raise _bad("prefix_key", "must be 64 lowercase hex digits")
    return v


@dataclass(frozen=True, slots=True)
class PullRequest:
    """``POST /v1/pulls``: pull the KV a decode request's ``kv_transfer_params`` name."""

    params: RemotePrefillParams
    timeout_s: float | None = None
    """The pull's deadline from now (None: the sidecar's ``pull_timeout_s``)."""
    wait_s: float = 0.0
    """Answer once the pull is over or this much time has passed (a long poll; capped)."""
    fingerprint: Fingerprint | None = None
    """The puller's KV layout: an export of another is refused (``fingerprint_mismatch``)."""

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PullRequest:
        raw = body.get("kv_transfer_params") or {}
        if not isinstance(raw, dict):  # found by fuzzing: a number here was a 500
            raise _bad("kv_transfer_params", "must be an object", "bad_kv_transfer_params")
        try:
            params = RemotePrefillParams.from_dict(raw)
        except KVParamsError as e:
            raise ApiError(
                400, "bad_kv_transfer_params", str(e), param=f"kv_transfer_params.{e.field}"
            ) from None
        return cls(
            params=params,
            timeout_s=_seconds(body, "timeout_s", MAX_LEASE_S),
            wait_s=parse_wait(body.get("wait_s"), "wait_s"),
            fingerprint=_fingerprint(body),
        )


def parse_wait(value: object, field: str = "wait") -> float:
    """A long-poll wait (``wait_s`` in a body, ``?wait=`` in a query): seconds >= 0, capped at
    ``MAX_WAIT_S`` so a lost client does not hold a thread for longer."""
    if value is None:
        return 0.0
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise _bad(field, "must be a number of seconds") from None
    if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
        raise _bad(field, "must be a number of seconds >= 0")  # (NaN fails >= too)
    return min(float(value), MAX_WAIT_S)
