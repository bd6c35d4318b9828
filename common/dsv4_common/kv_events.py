"""KV cache events: what an engine's prefix cache gained and lost, step by step.

vLLM's schema and wire format (msgspec structs, tagged, array-like, msgpack), so a consumer
of vLLM's events (llm-d, Dynamo) decodes ours, and ours decode theirs:

- ``BlockStored``: full blocks got their chained hashes (a run: each block's parent is the
  previous one, the first's is ``parent_block_hash``; ``token_ids`` are the run's tokens);
- ``BlockRemoved``: hashes evicted from the cache;
- ``AllBlocksCleared``: the cache was reset, or the publisher (re)started: forget this rank;
- ``KVEventBatch``: one engine step's events, with a wall-clock timestamp and the DP rank.

V4's hybrid cache adds one kind of entry. A prefix ending at block boundary ``b`` is usable
only if the sequence state at ``b`` (window ring, compressor state) has a snapshot, and
snapshots are evicted on their own. They travel as events of group 1
(``group_idx=SNAPSHOT_GROUP``, ``kv_cache_spec_kind=SNAPSHOT_KIND``): a stored snapshot is a
``BlockStored`` whose one hash is the snapshot key ``snapshot_hash(h_b, next_token)``, with
``parent_block_hash = h_b`` (the boundary's block hash) and ``token_ids = [next_token]`` when
the key includes the token after the boundary (MTP), else ``[]``; an evicted one is a
``BlockRemoved`` of that key in group 1. Group 0 (``group_idx`` None) is the paged blocks.
``KVEventBatch.snapshot_bounded`` says whether this engine needs a snapshot at all (False: a
stateless model without MTP, whose every cached block run is usable).

Transport (``ZmqEventPublisher`` in the engine): ZMQ PUB multipart ``(topic, seq, payload)``
with ``seq`` an 8-byte big-endian counter per publisher starting at 0; replay over a ROUTER
socket: a DEALER sends ``(b"", start_seq)`` and gets ``(b"", seq, payload)`` for every
buffered batch from ``start_seq`` on, then ``(b"", REPLAY_END, b"")``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

SNAPSHOT_GROUP = 1
SNAPSHOT_KIND = "dsv4_state_snapshot"
MEDIUM_DEVICE = "GPU"  # vLLM's name for accelerator memory, whatever the accelerator
MEDIUM_HOST = "CPU"  # the sidecar's host tier (vLLM's connectors' name for host memory)
MEDIUM_DISK = "DISK"  # the sidecar's disk tier under it
SIDECAR_MEDIA = (MEDIUM_HOST, MEDIUM_DISK)  # a prefix pullable from the events' host_tier
REPLAY_END = (-1).to_bytes(8, "big", signed=True)

BlockHash = bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged union."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_DEVICE
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_DEVICE
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[Event]
    # extra trailing fields (vLLM's decoders ignore them): hits stop at the deepest snapshot;
    # ``HOST:PORT`` of the sidecar whose host tier holds this publisher's medium "CPU" entries
    snapshot_bounded: bool = False
    host_tier: str | None = None


def snapshot_hash(block_hash: BlockHash, next_token: int = -1) -> BlockHash:
    """The key of the state snapshot at the end of the block hashed ``block_hash`` (``-1``:
    the key has no next token, the engine runs without MTP)."""
    h = hashlib.sha256(b"dsv4-snapshot-v1")
    h.update(block_hash)
    h.update(next_token.to_bytes(8, "little", signed=True))
    return h.digest()


def snapshot_stored(
    block_hash: BlockHash, next_token: int, block_size: int, medium: str = MEDIUM_DEVICE
) -> BlockStored:
    return BlockStored(
        block_hashes=[snapshot_hash(block_hash, next_token)],
        parent_block_hash=block_hash,
        token_ids=[next_token] if next_token >= 0 else [],
        block_size=block_size,
        medium=medium,
        group_idx=SNAPSHOT_GROUP,
        kv_cache_spec_kind=SNAPSHOT_KIND,
    )


def snapshot_removed(
    block_hash: BlockHash, next_token: int, medium: str = MEDIUM_DEVICE
) -> BlockRemoved:
    return BlockRemoved(
        [snapshot_hash(block_hash, next_token)], medium=medium, group_idx=SNAPSHOT_GROUP
    )


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on a malformed payload."""
    return _decoder.decode(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


def rank_endpoints(endpoint: str, rank: int) -> tuple[str, str]:
    """(PUB, replay ROUTER) endpoints of DP rank ``rank`` for ``--kv-events-endpoint``
    ``tcp://HOST:PORT``: rank r publishes on PORT+2r and replays on PORT+2r+1."""
    host, port = parse_endpoint(endpoint)
    base = port + 2 * rank
    return f"tcp://{host}:{base}", f"tcp://{host}:{base + 1}"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (HOST, PORT); ValueError naming what is wrong."""
    rest = endpoint.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if rest == endpoint or not sep or not host or not port.isdigit():
        raise ValueError(f"KV events endpoint must be tcp://HOST:PORT, got {endpoint!r}")
    if not 0 < int(port) < 65535:
        raise ValueError(f"KV events endpoint port out of range in {endpoint!r}")
    return host, int(port)
