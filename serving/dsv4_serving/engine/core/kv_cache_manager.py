"""Who holds which KV blocks and state slots; prefix-cache lookup. Pure Python.

Two kinds of cache memory, as the model layer defines them:
  - paged blocks (one pool, one block table per request) for everything that grows with the
    sequence: V4's compressed entries and indexer keys of every layer, V3's MLA latents;
  - fixed-size state slots, one per running request (V4's window ring and compressor state).
Both are sized at start-up and freed on finish, abort and preemption.

Prefix caching over a hybrid cache: paged blocks are shared by chained hash, but a sequence's
state (window ring, unfinished compressor block) cannot be rebuilt from them. So states are
snapshotted into spare slots at block boundaries: boundaries inside a chunk are written by the
model during the forward (``plan_snapshots``), a chunk ending exactly on a boundary is copied
after the step. A later request can only hit prefixes whose boundary has a snapshot. With MTP
on, the draft layer's row at the boundary's last position depends on the token after the
boundary, so the key includes that token. Snapshots are evicted LRU, independently of blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from dsv4_common.kv_events import (
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    BlockStored,
    KVCacheEvent,
    snapshot_hash,
    snapshot_removed,
    snapshot_stored,
)
from dsv4_kvtransfer.pd_protocol import prefix_transfer_id
from dsv4_serving.engine.core.block_pool import BlockPool, KVBlock
from dsv4_serving.engine.core.prefix_hash import BlockHash
from dsv4_serving.engine.request import Request

BoundaryKey = tuple[BlockHash, int]
Landing = tuple[int, int | None]  # a boundary a step may start at, its snapshot slot


@dataclass(slots=True)
class ComputedPrefix:
    """A prefix-cache hit: blocks to share, the tokens they cover, the snapshot to restore."""

    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0
    restore_slot: int | None = None


@dataclass(frozen=True, slots=True)
class Offer:
    """A finished request's prefix to offer to the host tier: its first ``num_blocks`` blocks
    and the snapshot slot of the state at their end (None: the model has no state)."""

    num_blocks: int
    slot: int | None
    key: str  # ``prefix_key``: the boundary's snapshot key, hex


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_seq_slots: int,
        enable_caching: bool = True,
        has_state: bool = False,
        num_snapshot_slots: int = 0,
        key_next_token: bool = False,
        enable_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching, enable_events)
        self.enable_caching = enable_caching
        self.has_state = has_state
        self.key_next_token = key_next_token
        # seq slots first, snapshot slots after them
        self.num_seq_slots = num_seq_slots
        self._free_slots: list[int] = list(range(num_seq_slots - 1, -1, -1))  # pop() -> 0 first
        snap = list(range(num_seq_slots, num_seq_slots + num_snapshot_slots)) if has_state else []
        self._free_snapshots = snap[::-1]
        self.num_snapshot_slots = len(snap)
        self._boundaries: OrderedDict[BoundaryKey, int | None] = OrderedDict()  # LRU first
        self._boundary_capacity = 2 * num_blocks  # stateless models: keys only
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_slot: dict[str, int] = {}
        self._block_ids: dict[str, list[int]] = {}  # ``block_ids``' lists, by request
        self._num_cached: dict[str, int] = {}
        self._copies: list[tuple[int, int]] = []  # (src slot, dst slot), in order
        # boundaries being snapshotted by the step in flight: published after it ran
        self._pending: dict[str, list[tuple[BoundaryKey, int | None]]] = {}
        self._pending_keys: set[BoundaryKey] = set()
        # snapshots taken out of the LRU while an offer copies them (request id -> key, slot)
        self._offering: dict[str, tuple[BoundaryKey, int | None]] = {}
        self._offer_keys: dict[str, BoundaryKey] = {}  # every offer's, for its event
        # host-tier entries announced, by transfer id (their eviction is announced too), and
        # ids evicted before their offer's result came back (never announced then)
        self._host_keys: dict[str, BoundaryKey] = {}
        self._host_media: dict[str, str] = {}  # those announced on disk ("CPU" if absent)
        self._host_gone: OrderedDict[str, None] = OrderedDict()
        # async scheduling: (boundary, slot) reserved for steps in flight that may start there
        self._landing: dict[str, list[Landing]] = {}

    @property
    def num_slots(self) -> int:
        return self.num_seq_slots + self.num_snapshot_slots

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def usage(self) -> float:
        return self.pool.usage()

    def _needs_boundary(self) -> bool:
        return self.has_state or self.key_next_token

    @property
    def snapshot_bounded(self) -> bool:
        """A cached prefix is usable only up to its deepest boundary key (the events say so)."""
        return self.enable_caching and self._needs_boundary()

    def take_events(self) -> list[KVCacheEvent]:
        """KV events since the last call, in order (empty when events are off)."""
        return self.pool.take_events()

    def _record_snapshot(self, key: BoundaryKey, stored: bool, medium: str = MEDIUM_DEVICE) -> None:
        if self.pool.events is not None:  # events off: not even the key's hash
            ev: KVCacheEvent
            if stored:
                ev = snapshot_stored(*key, self.block_size, medium)
            else:
                ev = snapshot_removed(*key, medium)
            self.pool.events.append(ev)

    def _stored(self, req: Request, stored: list[int]) -> None:
        """One ``BlockStored`` per contiguous run of newly published block indexes."""
        hashes, bs = req.block_hashes, self.block_size
        run_start = 0
        for k in range(1, len(stored) + 1):
            if k < len(stored) and stored[k] == stored[k - 1] + 1:
                continue
            first, last = stored[run_start], stored[k - 1]
            assert self.pool.events is not None
            self.pool.events.append(
                BlockStored(
                    block_hashes=hashes[first : last + 1],
                    parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=list(req.all_token_ids[first * bs : (last + 1) * bs]),
                    block_size=bs,
                )
            )
            run_start = k

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and published snapshot (only when no request holds a
        block); records ``AllBlocksCleared``."""
        if not self.pool.reset_prefix_cache():
            return False
        for slot in self._boundaries.values():
            if slot is not None:
                self._free_snapshots.append(slot)
        self._boundaries.clear()
        return True

    def _key(self, req: Request, num_blocks: int) -> BoundaryKey | None:
        b = num_blocks * self.block_size
        nxt = -1
        if self.key_next_token:
            if req.num_tokens <= b:
                return None
            nxt = req.all_token_ids[b]
        return (req.block_hashes[num_blocks - 1], nxt)

    # ---- lookup and allocation -----------------------------------------------------------

    def get_computed_blocks(self, req: Request) -> ComputedPrefix:
        """The longest usable cached prefix of ``req`` (always leaves one token to compute)."""
        if not self.enable_caching:
            return ComputedPrefix()
        hashes = req.update_block_hashes(self.block_size)
        limit = (req.num_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        for h in hashes[:limit]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hit.append(b)
        restore = None
        if self._needs_boundary():
            while hit:
                key = self._key(req, len(hit))
                if key is not None and key in self._boundaries:
                    restore = self._boundaries[key]
                    self._boundaries.move_to_end(key)
                    break
                hit.pop()
        return ComputedPrefix(hit, len(hit) * self.block_size, restore)

    def can_fit(
        self, req: Request, num_tokens: int, computed: ComputedPrefix | None = None
    ) -> bool:
        held = len(self.req_blocks.get(req.request_id, ()))
        shared = computed.blocks if computed else []
        need = -(-num_tokens // self.block_size) - held - len(shared)
        # shared blocks nobody holds sit in the free list; taking them shrinks it
        idle = sum(1 for b in shared if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - idle:
            return False
        return req.request_id in self.req_slot or bool(self._free_slots)

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed: ComputedPrefix | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Blocks covering ``num_computed (or the hit) + num_new + lookahead`` tokens, and a
        state slot; False (nothing changed) when the pool cannot provide them."""
        base = computed.num_tokens if computed else req.num_computed_tokens
        total = base + num_new_tokens + num_lookahead_tokens
        if computed is None and req.request_id in self.req_slot:
            held = self.req_blocks.get(req.request_id)
            if held is not None and -(-total // self.block_size) <= len(held):
                return True  # a decode step inside its blocks: nothing to allocate
        if not self.can_fit(req, total, computed):
            return False
        blocks = self.req_blocks.setdefault(req.request_id, [])
        if computed and computed.blocks:
            self.pool.touch(computed.blocks)
            blocks.extend(computed.blocks)
            self._num_cached[req.request_id] = len(computed.blocks)
        need = -(-total // self.block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.get_new_blocks(need))
        if req.request_id not in self.req_slot:
            slot = self._free_slots.pop()
            self.req_slot[req.request_id] = slot
            if computed and computed.restore_slot is not None:
                self._copies.append((computed.restore_slot, slot))
        return True

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids: the same list object until its blocks change, then a new
        one (blocks are only appended until ``free``), never changed in place. A step keeps
        the list it was given (async: while the next is scheduled) and the runner's block
        table sees by identity which rows changed; so callers must not mutate it."""
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return []
        ids = self._block_ids.get(request_id)
        if ids is None or len(ids) != len(blocks):
            ids = self._block_ids[request_id] = [b.block_id for b in blocks]
        return ids

    def prefix_key(self, req: Request, num_blocks: int) -> str | None:
        """The host tier's key of ``req``'s first ``num_blocks`` blocks (None: the boundary
        is not keyable yet: MTP keys need the token after it)."""
        hashes = req.update_block_hashes(self.block_size)
        if not 0 < num_blocks <= len(hashes):
            return None
        key = self._key(req, num_blocks)
        return snapshot_hash(*key).hex() if key is not None else None

    def begin_offer(self, req: Request) -> Offer | None:
        """The deepest prefix of finished ``req`` usable elsewhere: whole computed blocks up to
        a boundary with a snapshot (any boundary for a model without state). Its snapshot slot
        leaves the LRU until ``free(req)``, so no other request's snapshot overwrites it while
        the offer copies it."""
        if not self.enable_caching or req.request_id in self._offering:
            return None
        hashes = req.update_block_hashes(self.block_size)
        held = len(self.req_blocks.get(req.request_id, ()))
        for b in range(min(req.num_computed_tokens // self.block_size, len(hashes), held), 0, -1):
            key = self._key(req, b)
            if key is None:
                continue
            if not self.has_state:
                if self._needs_boundary() and key not in self._boundaries:
                    continue
                self._offer_keys[req.request_id] = key
                return Offer(b, None, snapshot_hash(*key).hex())
            slot = self._boundaries.get(key)
            if slot is not None:
                del self._boundaries[key]
                self._offering[req.request_id] = (key, slot)
                self._offer_keys[req.request_id] = key
                return Offer(b, slot, snapshot_hash(*key).hex())
        return None

    def offer_stored(self, req: Request) -> None:
        """``req``'s offer is in the host tier: announce its key with medium ``"CPU"`` (the
        tier evicts on its own, unannounced: a pull of an evicted entry is computed)."""
        key = self._offer_keys.get(req.request_id)
        if key is None or self.pool.events is None:
            return
        tid = prefix_transfer_id(snapshot_hash(*key).hex())
        if tid in self._host_gone:  # evicted already
            del self._host_gone[tid]
            return
        self._host_keys[tid] = key
        self._host_media.pop(tid, None)
        self._record_snapshot(key, stored=True, medium=MEDIUM_HOST)

    def host_tier_moved(self, moves: list[tuple[str, str | None]]) -> None:
        """Our sidecar's records, in order: an announced entry now in another tier ("DISK" or
        "CPU") is announced gone from the old medium and stored in the new one; None: gone."""
        for tid, medium in moves:
            key = self._host_keys.get(tid)
            if medium is None:
                self.host_evicted([tid])
            elif key is not None and medium != self._host_media.get(tid, MEDIUM_HOST):
                self._record_snapshot(
                    key, stored=False, medium=self._host_media.get(tid, MEDIUM_HOST)
                )
                self._record_snapshot(key, stored=True, medium=medium)
                self._host_media[tid] = medium

    def host_evicted(self, transfer_ids: list[str]) -> None:
        """Our sidecar's tiers dropped these entries: announce each announced one gone."""
        for tid in transfer_ids:
            key = self._host_keys.pop(tid, None)
            if key is not None:
                medium = self._host_media.pop(tid, MEDIUM_HOST)
                self._record_snapshot(key, stored=False, medium=medium)
                continue
            self._host_gone[tid] = None
            if len(self._host_gone) > 1024:
                self._host_gone.popitem(last=False)

    # ---- after a step --------------------------------------------------------------------

    def plan_snapshots(self, req: Request, start: int, end: int) -> list[tuple[int, int]]:
        """Boundaries strictly inside ``[start, end)`` (a chunk of known tokens) that have no
        snapshot yet: (boundary, snapshot slot) for the model to write during the forward."""
        if not (self.enable_caching and self._needs_boundary()):
            return []
        hashes = req.update_block_hashes(self.block_size)
        out = []
        for b in range(start // self.block_size + 1, -(-end // self.block_size)):
            if b > len(hashes):
                break
            key = self._key(req, b)
            if key is None or key in self._boundaries or key in self._pending_keys:
                continue
            slot = self._take_snapshot_slot() if self.has_state else None
            if self.has_state and slot is None:
                break
            self._pending.setdefault(req.request_id, []).append((key, slot))
            self._pending_keys.add(key)
            if slot is not None:
                out.append((b * self.block_size, slot))
        return out

    def cache_blocks(self, req: Request) -> None:
        """Publish the request's newly completed blocks and the snapshots its step wrote; at a
        block boundary reached exactly, snapshot its state slot."""
        if not self.enable_caching:
            return
        pending = self._pending.pop(req.request_id, None)
        for key, slot in pending or ():
            self._pending_keys.discard(key)
            self._publish(key, slot)
        computed, bs = req.num_computed_tokens, self.block_size
        if computed % bs and computed // bs <= self._num_cached.get(req.request_id, 0):
            # inside a block past the published ones (most decode steps): no block completed,
            # no exact boundary; the hashes are extended by whoever reads them next
            return
        n_full = self._cache_full_blocks(req)
        if (
            self._needs_boundary()
            and n_full > 0
            and req.num_computed_tokens == n_full * self.block_size
        ):
            key = self._key(req, n_full)
            if key is not None and key not in self._boundaries and key not in self._pending_keys:
                slot = self._take_snapshot_slot() if self.has_state else None
                if slot is not None:
                    self._copies.append((self.req_slot[req.request_id], slot))
                if slot is not None or not self.has_state:
                    self._publish(key, slot)

    def _cache_full_blocks(self, req: Request) -> int:
        """Publish ``req``'s computed blocks whose tokens are known; returns how many."""
        hashes = req.update_block_hashes(self.block_size)
        blocks = self.req_blocks[req.request_id]
        n_full = min(req.num_computed_tokens // self.block_size, len(hashes), len(blocks))
        done = self._num_cached.get(req.request_id, 0)
        stored = [i for i in range(done, n_full) if self.pool.cache_block(blocks[i], hashes[i])]
        if stored and self.pool.events is not None:
            self._stored(req, stored)
        self._num_cached[req.request_id] = max(done, n_full)
        return n_full

    # ---- async scheduling: boundaries reached by tokens still being sampled -------------

    def reserve_landing(self, req: Request, lo: int, hi: int) -> Landing | None:
        """A step of ``req`` being scheduled starts at a position in ``[lo, hi]`` (which one,
        and the tokens before it, the step in flight decides). If a block boundary there has
        no snapshot, reserve it one: the step thread copies ``req``'s state slot into it
        before that step's forward if the step starts at the boundary (the state after its
        last token, as the synchronous engine copies it), and ``landed`` publishes it."""
        bs = self.block_size
        b = hi // bs
        if not (self.enable_caching and self._needs_boundary()) or b == 0 or b * bs < lo:
            return None
        if len(req.update_block_hashes(bs)) >= b:
            key = self._key(req, b)
            if key is not None and (key in self._boundaries or key in self._pending_keys):
                return None
        slot = self._take_snapshot_slot() if self.has_state else None
        if self.has_state and slot is None:
            return None
        entry = (b * bs, slot)
        self._landing.setdefault(req.request_id, []).append(entry)
        return entry

    def landed(self, req: Request, entry: Landing, start: int) -> None:
        """The step ``entry`` was reserved for started at ``start`` (the boundary's tokens are
        known now): publish the block and the snapshot if it started at the boundary, else
        give the slot back."""
        entries = self._landing.get(req.request_id)
        if not entries or entry not in entries:
            return  # freed since
        entries.remove(entry)
        boundary, slot = entry
        b, key = boundary // self.block_size, None
        if start == boundary and self._cache_full_blocks(req) >= b:
            key = self._key(req, b)
        if key is None or key in self._boundaries or key in self._pending_keys:
            if slot is not None:
                self._free_snapshots.append(slot)
            return
        self._publish(key, slot)

    def snapshot_end(self, req: Request, end: int, in_flight: bool) -> None:
        """Finished ``req``'s state is at ``end`` (async scheduling): the boundary snapshot
        the synchronous engine takes there after its last step, from the step in flight's
        reservation (its copy comes before that step writes the slot) or, with no step in
        flight, from its slot before anyone else writes it."""
        for entry in self._landing.get(req.request_id, []):
            if entry[0] == end:
                self.landed(req, entry, end)
                return
        if not in_flight:
            self.cache_blocks(req)

    def _take_snapshot_slot(self) -> int | None:
        if self._free_snapshots:
            return self._free_snapshots.pop()
        while self._boundaries:
            key, slot = self._boundaries.popitem(last=False)  # evict the least recently used
            self._record_snapshot(key, stored=False)
            if slot is not None:
                return slot
        return None

    def _publish(self, key: BoundaryKey, slot: int | None) -> None:
        if not self.has_state and len(self._boundaries) >= self._boundary_capacity:
            old, _ = self._boundaries.popitem(last=False)
            self._record_snapshot(old, stored=False)
        self._boundaries[key] = slot
        self._record_snapshot(key, stored=True)

    def take_state_copies(self) -> list[tuple[int, int]]:
        """State-slot copies (src, dst) the runner must do, in order, before the next forward."""
        out, self._copies = self._copies, []
        return out

    def free(self, req: Request) -> None:
        self._offer_keys.pop(req.request_id, None)
        offered = self._offering.pop(req.request_id, None)
        if offered is not None:  # back into the LRU, most recently used
            key, slot = offered
            if key in self._boundaries or key in self._pending_keys:  # snapshotted again since
                if slot is not None:
                    self._free_snapshots.append(slot)
            else:
                self._boundaries[key] = slot
        for key, slot in self._pending.pop(req.request_id, []):
            self._pending_keys.discard(key)
            if slot is not None:
                self._free_snapshots.append(slot)
        for _, slot in self._landing.pop(req.request_id, []):
            if slot is not None:
                self._free_snapshots.append(slot)
        blocks = self.req_blocks.pop(req.request_id, [])
        self._block_ids.pop(req.request_id, None)
        self.pool.free_blocks(reversed(blocks))
        self._num_cached.pop(req.request_id, None)
        slot = self.req_slot.pop(req.request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
