"""Properties of the KV sidecar's wire and control bodies (hypothesis): any bytes are a frame or
a ``FrameError`` (never another exception, never a read past what the prefix announced), every
frame we encode reads back as itself, and any JSON body is a typed request or a 400
``ApiError`` naming the field. ``DSV4_FUZZ_EXAMPLES`` raises the example count."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_kvtransfer.control_requests import ExportRequest, PullRequest, parse_wait
from dsv4_kvtransfer.errors import ApiError
from dsv4_kvtransfer.frames import (
    MAGIC,
    PREFIX,
    PREFIX_SIZE,
    FrameError,
    FrameLimits,
    FrameType,
    PeerClosed,
    encode,
    parse_meta,
    read_frame,
)

EXAMPLES = int(os.environ.get("DSV4_FUZZ_EXAMPLES", "200"))
FAST = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize="DSV4_FUZZ_SEED" not in os.environ,  # CI: the same examples every run
    suppress_health_check=[HealthCheck.too_slow],
)
LIMITS = FrameLimits(max_meta=4096, max_payload=1 << 20)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _read(raw: bytes) -> Any:
    """``read_frame`` over a real socket pair holding exactly ``raw``, then EOF."""
    a, b = socket.socketpair()
    try:
        a.sendall(raw)
        a.shutdown(socket.SHUT_WR)
        b.settimeout(5)
        return read_frame(b, LIMITS)
    finally:
        a.close()
        b.close()


# a valid prefix with random fields, then random bytes: what a confused or hostile peer sends
prefixes = st.builds(
    lambda magic, version, ftype, flags, meta, payload: PREFIX.pack(
        magic, version, ftype, flags, meta, payload
    ),
    st.sampled_from([MAGIC, b"DSKX", b"GET "]),
    st.sampled_from([1, 1, 1, 0, 2]),
    st.integers(0, 255),
    st.integers(0, 65535),
    st.integers(0, 1 << 14),
    st.integers(0, 1 << 40),
)


@FAST
@given(head=st.one_of(prefixes, st.binary(max_size=PREFIX_SIZE)), tail=st.binary(max_size=512))
def test_any_bytes_are_a_frame_or_a_frame_error(head: bytes, tail: bytes) -> None:
    try:
        frame = _read(head + tail)
    except (FrameError, PeerClosed):
        return
    assert isinstance(frame.meta, dict)
    assert frame.payload_len <= LIMITS.max_payload
    assert frame.payload_len == 0 or frame.type is FrameType.DATA


@FAST
@given(
    ftype=st.sampled_from(sorted(set(FrameType) - {FrameType.DATA})),
    meta=st.dictionaries(st.text(max_size=16), json_values, max_size=6),
)
def test_encoded_frames_read_back_as_themselves(ftype: FrameType, meta: dict[str, Any]) -> None:
    raw = encode(ftype, meta)
    if len(raw) - PREFIX_SIZE > LIMITS.max_meta:
        return
    frame = _read(raw)
    assert (frame.type, frame.meta, frame.payload_len) == (ftype, meta, 0)


@FAST
@given(raw=st.binary(max_size=64))
def test_any_meta_bytes_are_an_object_or_bad_meta(raw: bytes) -> None:
    try:
        assert isinstance(parse_meta(raw), dict)
    except FrameError as e:
        assert e.reason == "bad_meta"


def _refused_clearly(parse: Any, body: Any) -> None:
    try:
        parse(body)
    except ApiError as e:
        assert e.status == 400 and str(e), body
        assert e.param is None or isinstance(e.param, str)


export_like = st.fixed_dictionaries(
    {},
    optional={
        "request_id": json_values,
        "buffers": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "name": json_values,
                    "dtype": st.sampled_from(["bfloat16", "float32", "uint8", "int4", 3]),
                    "shape": st.lists(st.integers(-2, 1 << 20), max_size=3) | json_values,
                    "group": json_values,
                },
            ),
            max_size=3,
        )
        | json_values,
        "block_ids": st.lists(st.integers(-1, 10), max_size=4) | json_values,
        "num_tokens": json_values,
        "lease_seconds": json_values,
        "engine_meta": json_values,
    },
)


@FAST
@given(body=st.one_of(export_like, st.dictionaries(st.text(max_size=12), json_values)))
def test_any_export_body_is_a_request_or_a_400(body: dict[str, Any]) -> None:
    _refused_clearly(ExportRequest.from_body, body)


@FAST
@given(
    body=st.one_of(
        st.fixed_dictionaries({"kv_transfer_params": json_values}),
        st.dictionaries(st.text(max_size=12), json_values),
    )
)
def test_any_pull_body_is_a_request_or_a_400(body: dict[str, Any]) -> None:
    _refused_clearly(PullRequest.from_body, body)


@FAST
@given(wait=st.none() | st.text(max_size=12))
def test_any_wait_parameter_is_seconds_or_a_400(wait: str | None) -> None:
    try:
        v = parse_wait(wait)
    except ApiError as e:
        assert e.status == 400 and e.param == "wait"
        return
    assert 0 <= v <= 60 and json.dumps(v)
