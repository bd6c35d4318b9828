"""The precise prefix index: which blocks and state snapshots one engine DP rank holds, built
from its KV events (``dsv4_common.kv_events``, docs/cluster-kv.md). Pure; the sockets that feed
it are ``kv_subscriber.py``'s.

Every batch carries a per-publisher sequence number. ``on_live`` says what to do with one that
arrives on the live stream; a gap or a restart asks the publisher to replay its ring from 0
and ``on_replay`` says how its answer resynchronises the index: from scratch when the ring
still starts at batch 0 (its ``AllBlocksCleared``), by continuing when it still holds the
batch expected next, and otherwise from what it holds (``lossy``: the batches in between are
gone, so the index starts over from the oldest it has, an underestimate).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from dsv4_common.kv_events import (
    SIDECAR_MEDIA,
    SNAPSHOT_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    snapshot_hash,
)


class Live(Enum):
    APPLY = "apply"  # the batch expected next
    SKIP = "skip"  # already applied (it came in a replay first)
    RESYNC = "resync"  # a gap, or the first batch seen is not 0: replay from 0


class Replay(Enum):
    REBUILD = "rebuild"  # the ring starts at 0: clear, apply it all
    CONTINUE = "continue"  # the ring holds the batch expected next: apply from there
    LOSSY = "lossy"  # batches are gone: clear, apply what the ring holds


def on_live(seq: int, expected: int | None, replayed_from: int | None = None) -> Live:
    """``replayed_from``: the first sequence number the last replay applied; live batches
    from there up to ``expected`` came in that replay. Any other old number is a restarted
    publisher whose batch 0 was missed."""
    # batch 0 is a publisher's AllBlocksCleared: from there on the batches are the whole story
    # (a new engine, or a restarted one)
    if seq == 0 or seq == expected:
        return Live.APPLY
    if expected is not None and replayed_from is not None and replayed_from <= seq < expected:
        return Live.SKIP
    return Live.RESYNC  # first contact after batch 0, a gap, or a restart


def on_replay(first_seq: int, expected: int | None) -> Replay:
    if first_seq == 0:
        return Replay.REBUILD
    if expected is not None and first_seq <= expected:
        return Replay.CONTINUE
    return Replay.LOSSY


@dataclass
class RankCache:
    """One engine DP rank's cached block hashes and snapshot keys, as its events say."""

    blocks: set[bytes] = field(default_factory=set)
    snapshots: set[bytes] = field(default_factory=set)
    host: set[bytes] = field(default_factory=set)
    """Snapshot keys of prefixes in the rank's sidecar host tier (medium ``"CPU"``) or its
    disk tier (``"DISK"``): both pulled alike, from ``host_tier``."""
    host_tier: str | None = None
    """``HOST:PORT`` of that sidecar (the batches' ``host_tier``): where a pull goes."""
    # each host key's boundary block hash, and how many keys end at each boundary
    _host_parent: dict[bytes, bytes] = field(default_factory=dict, repr=False)
    _host_parents: Counter[bytes] = field(default_factory=Counter, repr=False)
    snapshot_bounded: bool = False
    block_size: int | None = None
    expected: int | None = None  # the sequence number of the next batch to apply
    replayed_from: int | None = None  # the first batch the last replay applied
    batches: int = 0
    resyncs: int = 0
    lossy_resyncs: int = 0

    def clear(self) -> None:
        self.blocks.clear()
        self.snapshots.clear()
        self.host.clear()
        self._host_parent.clear()
        self._host_parents.clear()

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        if seq == 0:
            self.replayed_from = None  # a new publisher: older numbers are not its
        self.snapshot_bounded = batch.snapshot_bounded
        self.host_tier = batch.host_tier
        for ev in batch.events:
            target = self.snapshots if _group(ev) == SNAPSHOT_GROUP else self.blocks
            if getattr(ev, "medium", None) in SIDECAR_MEDIA:  # the host tier or its disk
                if isinstance(ev, BlockStored):
                    self._host_stored(ev)
                elif isinstance(ev, BlockRemoved):
                    self._host_removed(ev.block_hashes)
                continue
            if isinstance(ev, BlockStored):
                target.update(ev.block_hashes)
                if target is self.blocks:
                    self.block_size = ev.block_size
            elif isinstance(ev, BlockRemoved):
                target.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.clear()
        self.expected = seq + 1
        self.batches += 1

    def resync(self, replayed: Sequence[tuple[int, KVEventBatch]]) -> Replay | None:
        """Apply a replay's answer (sequence-ordered); None when it held nothing."""
        if not replayed:
            return None
        how = on_replay(replayed[0][0], self.expected)
        self.resyncs += 1
        if how is not Replay.CONTINUE:
            self.clear()
            self.lossy_resyncs += how is Replay.LOSSY
        start = self.expected if how is Replay.CONTINUE else None
        for seq, batch in replayed:
            if start is None or seq >= start:
                self.apply(seq, batch)
        self.replayed_from = start if start is not None else replayed[0][0]
        return how

    def usable_tokens(self, hashes: Sequence[bytes], token_ids: Sequence[int], bs: int) -> int:
        """Prompt tokens this rank would serve from its cache: the longest run of stored blocks
        from block 0 (one prompt token always left to compute, as the engine does), cut back,
        when the engine needs snapshots, to the deepest boundary with one (keyed with or
        without the next token: an MTP engine keys by it)."""
        if self.block_size != bs or not token_ids:
            return 0
        limit = min(len(hashes), (len(token_ids) - 1) // bs)
        n = 0
        while n < limit and hashes[n] in self.blocks:
            n += 1
        if self.snapshot_bounded:
            while n and not self._has_snapshot(hashes[n - 1], token_ids[n * bs]):
                n -= 1
        return n * bs

    def host_prefix(
        self, hashes: Sequence[bytes], token_ids: Sequence[int], bs: int
    ) -> tuple[int, bytes] | None:
        """The deepest prefix of the prompt the rank's host tier holds (one prompt token left
        to compute): its tokens and key; None if none (or the rank's block size differs).
        Keys are hashed only at boundaries some entry ends at (``_host_parents``)."""
        if self.block_size not in (None, bs) or not token_ids or not self._host_parents:
            return None
        for n in range(min(len(hashes), (len(token_ids) - 1) // bs), 0, -1):
            if hashes[n - 1] not in self._host_parents:
                continue
            for key in (
                snapshot_hash(hashes[n - 1]),
                snapshot_hash(hashes[n - 1], token_ids[n * bs]),
            ):
                if key in self.host:
                    return n * bs, key
        return None

    def _host_stored(self, ev: BlockStored) -> None:
        for key in ev.block_hashes:
            if key in self.host or ev.parent_block_hash is None:
                continue
            self.host.add(key)
            self._host_parent[key] = ev.parent_block_hash
            self._host_parents[ev.parent_block_hash] += 1

    def _host_removed(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            parent = self._host_parent.pop(key, None)
            self.host.discard(key)
            if parent is not None:
                self._host_parents[parent] -= 1
                if not self._host_parents[parent]:
                    del self._host_parents[parent]

    def _has_snapshot(self, block_hash: bytes, next_token: int) -> bool:
        return (
            snapshot_hash(block_hash) in self.snapshots
            or snapshot_hash(block_hash, next_token) in self.snapshots
        )


def _group(ev: object) -> int | None:
    return getattr(ev, "group_idx", None)
