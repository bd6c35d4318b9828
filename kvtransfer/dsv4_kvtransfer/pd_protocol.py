"""vLLM's prefill/decode protocol: the one module engine, gateway, sidecar and tests use.

A PD request goes twice through the engines, carrying ``kv_transfer_params`` in its body:

1. gateway -> prefill engine: the client's request with ``max_tokens=1``, ``stream=false`` and
   ``kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false, remote_engine_id:
   null, remote_block_ids: null, remote_host: null, remote_port: null}`` (``PrefillRequestParams``).
2. the prefill engine computes the prompt, keeps its KV under a lease and answers with
   ``kv_transfer_params`` = ``RemotePrefillParams`` (``do_remote_prefill: true``, where the KV is
   and how to pull it).
3. gateway -> decode engine: the client's request again, with the prefill answer's
   ``kv_transfer_params`` copied in unchanged; the decode engine pulls the KV, then decodes.

Field names are vLLM's (NIXL connector) so vLLM's proxies and routers can drive these engines
and this gateway can drive vLLM's. ``remote_host``/``remote_port`` name the prefill side's KV
endpoint (its sidecar), as NIXL's side channel does. The ``remote_transfer_id``...
``kv_protocol`` fields are this project's; unknown fields are kept (``extra``) and passed on.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KV_PROTOCOL_VERSION = 1
KV_TRANSFER_ERROR_TYPE = "kv_transfer_error"
"""The ``error.type`` a decode engine answers with when it could not get a request's KV (pull
failed, lease gone, layouts differ) and its failure policy is ``fail``: the request can be
retried on another decode engine, or prefilled again. Gateways match on this constant."""
MAX_BLOCK_IDS = 1 << 20
MAX_GROUPS = 256
_TRANSFER_ID = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
_NULL_IN_PREFILL_REQUEST = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")
SHM_SOURCE = "remote_shm"
"""An extra field the prefill sidecar adds: ``{name, tag, offset}`` of the export in its staging
region (its trailer follows the bytes), for a same-host decode sidecar to copy from directly."""
_SHM_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")
_SHM_TAG = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True, slots=True)
class ShmSource:
    name: str
    tag: str
    offset: int


def shm_source(extra: Mapping[str, Any]) -> ShmSource | None:
    """The export's place in the prefill sidecar's region, if the params carry a well-formed
    one (anything else: None, and the pull asks the peer as it always did)."""
    v = extra.get(SHM_SOURCE)
    if not isinstance(v, Mapping):
        return None
    name, tag, offset = v.get("name"), v.get("tag"), v.get("offset")
    if not (isinstance(name, str) and _SHM_NAME.match(name)):
        return None
    if not (isinstance(tag, str) and _SHM_TAG.match(tag)):
        return None
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        return None
    return ShmSource(name, tag, offset)


class KVParamsError(ValueError):
    """Malformed ``kv_transfer_params``; ``field`` names the offending key."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"kv_transfer_params.{field}: {message}")
        self.field = field


def _bool(d: Mapping[str, Any], key: str, default: bool) -> bool:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise KVParamsError(key, f"must be true or false, got {v!r}")
    return v


def _int(d: Mapping[str, Any], key: str, lo: int, hi: int, required: bool = True) -> int | None:
    v = d.get(key)
    if v is None:
        if required:
            raise KVParamsError(key, "is required")
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise KVParamsError(key, f"must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise KVParamsError(key, f"must be in [{lo}, {hi}], got {v}")
    return v


_IMMUTABLE = (str, int, float, bool, type(None))


def _copied(v: Any) -> Any:
    """A deep copy of a JSON value (``copy.deepcopy`` with a shortcut for the common cases:
    it cost a good part of parsing a decode request's params)."""
    if isinstance(v, _IMMUTABLE):
        return v
    if type(v) is dict and all(isinstance(x, _IMMUTABLE) for x in v.values()):
        return dict(v)
    return copy.deepcopy(v)


def _str(d: Mapping[str, Any], key: str, max_len: int = 256) -> str:
    v = d.get(key)
    if v is None:
        raise KVParamsError(key, "is required")
    if not isinstance(v, str) or not v:
        raise KVParamsError(key, f"must be a non-empty string, got {v!r}")
    if len(v) > max_len:
        raise KVParamsError(key, f"is longer than {max_len} characters")
    return v


PREFIX_PULL = "dsv4_prefix_pull"
"""The ``kv_transfer_params`` field of a prefix pull (``PrefixPullParams``): an extension
field, so vLLM's routers pass it through unknown."""
_PREFIX_KEY = re.compile(r"^[0-9a-f]{64}$")


def prefix_transfer_id(prefix_key: str) -> str:
    """The transfer id a sidecar's host tier keeps a prefix under: the first 96 bits of its
    key (the same size as an export's random id), so a puller names it without asking."""
    return prefix_key[:24]


@dataclass(frozen=True, slots=True)
class PrefixPullParams:
    """Pull the KV of a prompt's first ``num_tokens`` tokens (whole blocks, and the state
    snapshot at their end) from the host tier of the sidecar at ``remote_host:remote_port``,
    then compute the rest locally. ``prefix_key`` is the snapshot key of that boundary
    (``dsv4_common.kv_events.snapshot_hash``, hex): it names the tier's entry and commits to
    every token before it, so the engine checks it against its own prompt before it pulls."""

    remote_host: str
    remote_port: int
    num_tokens: int
    prefix_key: str

    @property
    def transfer_id(self) -> str:
        return prefix_transfer_id(self.prefix_key)

    def to_dict(self) -> dict[str, Any]:
        return {
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "num_tokens": self.num_tokens,
            "prefix_key": self.prefix_key,
        }

    @classmethod
    def from_dict(cls, value: object) -> PrefixPullParams:
        if not isinstance(value, Mapping):
            raise KVParamsError(PREFIX_PULL, f"must be an object, got {type(value).__name__}")
        f = f"{PREFIX_PULL}."
        try:
            host = _str(value, "remote_host", 253)
            port = _int(value, "remote_port", 1, 65535)
            num_tokens = _int(value, "num_tokens", 1, 1 << 40)
            key = _str(value, "prefix_key", 64)
        except KVParamsError as e:
            raise KVParamsError(f + e.field, str(e).split(": ", 1)[1]) from None
        if not _PREFIX_KEY.match(key):
            raise KVParamsError(f + "prefix_key", "must be 64 lowercase hex digits")
        unknown = sorted(set(value) - {"remote_host", "remote_port", "num_tokens", "prefix_key"})
        if unknown:
            raise KVParamsError(f + unknown[0], "is not a field of a prefix pull")
        assert port is not None and num_tokens is not None
        return cls(host, port, num_tokens, key)


@dataclass(frozen=True, slots=True)
class PrefillRequestParams:
    """What the gateway puts into the prefill request: compute, then keep the KV for a remote
    decode. ``prefix_pull``: a prefix of the prompt to pull from a host tier first."""

    prefix_pull: PrefixPullParams | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        if self.prefix_pull is not None:
            out[PREFIX_PULL] = self.prefix_pull.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PrefillRequestParams:
        if _bool(d, "do_remote_decode", False) is not True:
            raise KVParamsError("do_remote_decode", "must be true in a prefill request")
        if _bool(d, "do_remote_prefill", False):
            raise KVParamsError("do_remote_prefill", "must be false in a prefill request")
        for key in _NULL_IN_PREFILL_REQUEST:
            if d.get(key) is not None:
                raise KVParamsError(key, "must be null in a prefill request")
        pull = d.get(PREFIX_PULL)
        return cls(PrefixPullParams.from_dict(pull) if pull is not None else None)


def prefix_pull_of(params: object) -> PrefixPullParams | None:
    """The prefix pull a request's typed params ask for, if any."""
    if isinstance(params, PrefixPullParams):
        return params
    if isinstance(params, PrefillRequestParams):
        return params.prefix_pull
    return None


def without_prefix_pull(
    params: PrefillRequestParams | RemotePrefillParams | PrefixPullParams | None,
) -> PrefillRequestParams | RemotePrefillParams | None:
    """The params once the prefix is in (or was given up): what else the request asked."""
    if isinstance(params, PrefixPullParams):
        return None
    if isinstance(params, PrefillRequestParams):
        return PrefillRequestParams()
    return params


@dataclass(frozen=True, slots=True)
class RemotePrefillParams:
    """The prefill response's ``kv_transfer_params``, carried back unchanged in the decode
    request: where the prompt's KV is, and under which transfer id and lease."""

    remote_engine_id: str
    """The prefill engine's id."""
    remote_request_id: str
    """The request's id on the prefill engine."""
    remote_block_ids: tuple[int, ...]
    """The prefill engine's block ids holding the prompt's paged KV (informational here: the
    sidecar addresses KV by transfer id)."""
    remote_host: str
    """The prefill sidecar's address for KV pulls."""
    remote_port: int
    """The prefill sidecar's port for KV pulls."""
    remote_transfer_id: str
    """The sidecar's handle for the exported KV."""
    remote_lease_expires_at: float
    """Unix time after which the prefill side may have freed the KV."""
    remote_num_tokens: int
    """Tokens whose KV was exported (the prompt's computed tokens)."""
    remote_total_bytes: int
    """Bytes the decode side must pull (for admission and timeouts)."""
    remote_state_slot: int | None = None
    """The prefill engine's per-sequence state slot (window ring, compressor state), if any."""
    remote_cache_groups: dict[str, int] = field(default_factory=dict)
    """Blocks (paged groups) or rows (per-sequence groups) exported per cache group."""
    tp_size: int = 1
    """The prefill instance's tensor-parallel size (vLLM's NIXL field)."""
    kv_protocol: int = KV_PROTOCOL_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields this version does not know, passed on unchanged."""

    KNOWN = (
        "do_remote_prefill",
        "do_remote_decode",
        "remote_engine_id",
        "remote_request_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
        "remote_transfer_id",
        "remote_lease_expires_at",
        "remote_num_tokens",
        "remote_total_bytes",
        "remote_state_slot",
        "remote_cache_groups",
        "tp_size",
        "kv_protocol",
    )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: _copied(v) for k, v in self.extra.items()}
        out.update(
            {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.remote_engine_id,
                "remote_request_id": self.remote_request_id,
                "remote_block_ids": list(self.remote_block_ids),
                "remote_host": self.remote_host,
                "remote_port": self.remote_port,
                "remote_transfer_id": self.remote_transfer_id,
                "remote_lease_expires_at": self.remote_lease_expires_at,
                "remote_num_tokens": self.remote_num_tokens,
                "remote_total_bytes": self.remote_total_bytes,
                "remote_state_slot": self.remote_state_slot,
                "remote_cache_groups": dict(self.remote_cache_groups),
                "tp_size": self.tp_size,
                "kv_protocol": self.kv_protocol,
            }
        )
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RemotePrefillParams:
        if _bool(d, "do_remote_prefill", False) is not True:
            raise KVParamsError("do_remote_prefill", "must be true in a decode request")
        if _bool(d, "do_remote_decode", False):
            raise KVParamsError("do_remote_decode", "must be false in a decode request")
        version = _int(d, "kv_protocol", 0, 1 << 16, required=False)
        if version is not None and version != KV_PROTOCOL_VERSION:
            raise KVParamsError(
                "kv_protocol", f"version {version} is not supported (this side speaks 1)"
            )
        blocks = d.get("remote_block_ids")
        if not isinstance(blocks, list):
            raise KVParamsError("remote_block_ids", f"must be a list of integers, got {blocks!r}")
        if len(blocks) > MAX_BLOCK_IDS:
            raise KVParamsError("remote_block_ids", f"more than {MAX_BLOCK_IDS} ids")
        for b in blocks:
            if not isinstance(b, int) or isinstance(b, bool) or b < 0:
                raise KVParamsError("remote_block_ids", f"{b!r} is not a non-negative integer")
        transfer_id = _str(d, "remote_transfer_id", 64)
        if not _TRANSFER_ID.match(transfer_id):
            raise KVParamsError("remote_transfer_id", "must be 1-64 characters of [A-Za-z0-9_-]")
        expires = d.get("remote_lease_expires_at")
        if not isinstance(expires, int | float) or isinstance(expires, bool) or expires < 0:
            raise KVParamsError(
                "remote_lease_expires_at", f"must be a non-negative unix time, got {expires!r}"
            )
        groups = d.get("remote_cache_groups") or {}
        if not isinstance(groups, Mapping) or len(groups) > MAX_GROUPS:
            raise KVParamsError(
                "remote_cache_groups", f"must map at most {MAX_GROUPS} group names to counts"
            )
        for k, v in groups.items():
            if not isinstance(k, str) or not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise KVParamsError("remote_cache_groups", f"bad entry {k!r}: {v!r}")
        return cls(
            remote_engine_id=_str(d, "remote_engine_id"),
            remote_request_id=_str(d, "remote_request_id"),
            remote_block_ids=tuple(blocks),
            remote_host=_str(d, "remote_host", 253),
            remote_port=_int(d, "remote_port", 1, 65535),  # type: ignore[arg-type]
            remote_transfer_id=transfer_id,
            remote_lease_expires_at=float(expires),
            remote_num_tokens=_int(d, "remote_num_tokens", 0, 1 << 40),  # type: ignore[arg-type]
            remote_total_bytes=_int(d, "remote_total_bytes", 0, 1 << 46),  # type: ignore[arg-type]
            remote_state_slot=_int(d, "remote_state_slot", 0, 1 << 31, required=False),
            remote_cache_groups=dict(groups),
            tp_size=_int(d, "tp_size", 1, 1 << 16, required=False) or 1,
            kv_protocol=KV_PROTOCOL_VERSION,
            extra={k: _copied(v) for k, v in d.items() if k not in cls.KNOWN},
        )


def parse_kv_transfer_params(
    value: object,
) -> PrefillRequestParams | RemotePrefillParams | PrefixPullParams | None:
    """Classify a request's ``kv_transfer_params``: ``None`` for an ordinary request (absent, or
    neither flag set), a prefill request (which may carry a prefix pull), a decode request, or
    an ordinary request with a prefix pull; ``KVParamsError`` if malformed."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise KVParamsError("", f"must be an object, got {type(value).__name__}")
    decode = _bool(value, "do_remote_decode", False)
    prefill = _bool(value, "do_remote_prefill", False)
    if decode and prefill:
        raise KVParamsError("do_remote_prefill", "and do_remote_decode cannot both be true")
    if decode:
        return PrefillRequestParams.from_dict(value)
    if prefill:
        if value.get(PREFIX_PULL) is not None:  # its whole prompt's KV comes anyway
            raise KVParamsError(PREFIX_PULL, "cannot go with do_remote_prefill")
        return RemotePrefillParams.from_dict(value)
    pull = value.get(PREFIX_PULL)
    return PrefixPullParams.from_dict(pull) if pull is not None else None


def prefill_overrides(body: Mapping[str, Any]) -> dict[str, Any]:
    """A prefill for a remote decode makes exactly one token: the fields of a request ``body``
    that this rule overrides. The KV it exports is the prompt's, and its one token is the
    decode's first (computed again there); ``min_tokens`` and stop strings would contradict or
    cut it. The gateway's ``prefill_request`` and the engine's API edge both apply this."""
    out: dict[str, Any] = {"max_tokens": 1}
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    if body.get("min_tokens"):
        out["min_tokens"] = 1
    if body.get("stop"):
        out["stop"] = None
    return out


def prefill_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The gateway's prefill request for a client request body (vLLM's toy proxy does the same):
    one token (``prefill_overrides``), no streaming, ``do_remote_decode``. Only top-level
    fields change, so a shallow copy leaves ``body`` as it was (a deep one costs the gateway
    CPU per request). A prefix pull the gateway put into ``body``'s params is kept."""
    out = dict(body)
    out.update(prefill_overrides(body))
    out["stream"] = False
    out.pop("stream_options", None)
    params = PrefillRequestParams().to_dict()
    given = body.get("kv_transfer_params")
    if isinstance(given, Mapping) and given.get(PREFIX_PULL) is not None:
        params[PREFIX_PULL] = given[PREFIX_PULL]
    out["kv_transfer_params"] = params
    return out


def decode_request(body: Mapping[str, Any], prefill_response: Mapping[str, Any]) -> dict[str, Any]:
    """The gateway's decode request: the client's body plus the prefill answer's params
    (checked here, so a broken prefill answer fails at the gateway with a clear message)."""
    params = prefill_response.get("kv_transfer_params")
    if params is None:
        raise KVParamsError("", "the prefill response carries no kv_transfer_params")
    parsed = parse_kv_transfer_params(params)
    if not isinstance(parsed, RemotePrefillParams):
        raise KVParamsError("do_remote_prefill", "the prefill response's params must set it true")
    out = dict(body)  # shallow: only kv_transfer_params changes
    out["kv_transfer_params"] = parsed.to_dict()
    return out
