"""The scheduler's half of prefix pulls and prefix offers (the connector moves the bytes).

A request carrying a prefix pull (``PrefixPullParams``) is parked like a decode whose KV comes
from a prefill, but only its first ``num_tokens`` tokens arrive: the blocks the local cache
already holds are shared as on any hit, the pulled ones are loaded after them, and the state
snapshot at the prefix's end goes into its slot. The pull is dropped (the prompt is computed
as usual) when the local cache already covers it, or when its key is not this prompt's.
"""

from __future__ import annotations

from dsv4_kvtransfer.pd_protocol import prefix_pull_of, without_prefix_pull
from dsv4_serving.engine.core.kv_cache_manager import ComputedPrefix, KVCacheManager
from dsv4_serving.engine.kv_connector.base import KVConnectorScheduler
from dsv4_serving.engine.request import Request, RequestStatus


def pullable_tokens(kv: KVCacheManager, req: Request) -> int:
    """Tokens of ``req``'s prefix pull worth pulling: 0 if it is to be dropped (its key is not
    this prompt's, it leaves no token to compute, or the local cache covers it)."""
    pull = prefix_pull_of(req.kv_transfer_params)
    if pull is None:
        return 0
    n, bs = pull.num_tokens, kv.block_size
    if n % bs or n >= req.num_tokens or kv.prefix_key(req, n // bs) != pull.prefix_key:
        return 0
    return n if kv.get_computed_blocks(req).num_tokens < n else 0


def park_for_prefix(
    kv: KVCacheManager, connector: KVConnectorScheduler, req: Request, lookahead: int
) -> bool | None:
    """Allocate ``req``'s prompt (the local hit shared) and start its prefix pull: True when
    parked, None when its blocks cannot be had yet, False when the pull was dropped (the
    request is then an ordinary prompt)."""
    pull = prefix_pull_of(req.kv_transfer_params)
    assert pull is not None
    if not pullable_tokens(kv, req):
        drop_prefix_pull(connector, req)
        return False
    hit = kv.get_computed_blocks(req)
    # the pulled state replaces the hit's: no snapshot restore into the slot
    local = ComputedPrefix(hit.blocks, hit.num_tokens, None)
    if not kv.allocate_slots(req, req.num_tokens - hit.num_tokens, local, lookahead):
        return None
    first = len(hit.blocks)
    blocks = kv.block_ids(req.request_id)[first : pull.num_tokens // kv.block_size]
    req.status = RequestStatus.WAITING_FOR_REMOTE_KV
    connector.update_state_after_alloc(req, blocks, kv.req_slot[req.request_id], first)
    return True


def drop_prefix_pull(connector: KVConnectorScheduler, req: Request) -> None:
    """Compute ``req``'s prompt here after all (a refused or failed pull)."""
    pull = prefix_pull_of(req.kv_transfer_params)
    if pull is not None:
        connector.prefix_not_pulled(pull.num_tokens)
        req.kv_transfer_params = without_prefix_pull(req.kv_transfer_params)


def prefix_loaded(req: Request) -> None:
    """The pulled prefix is in ``req``'s blocks and slot: the rest of its prompt is computed
    as any running prompt's."""
    pull = prefix_pull_of(req.kv_transfer_params)
    assert pull is not None
    req.num_computed_tokens = pull.num_tokens
    if req.num_cached_tokens < 0:
        req.num_cached_tokens = pull.num_tokens
    req.kv_transfer_params = without_prefix_pull(req.kv_transfer_params)


def offer_finished(kv: KVCacheManager, connector: KVConnectorScheduler, req: Request) -> bool:
    """Offer finished ``req``'s deepest usable prefix to our host tier: True if an offer
    started (its blocks and snapshot stay held until it ended)."""
    if not connector.offers_prefixes:
        return False
    offer = kv.begin_offer(req)
    if offer is None:
        return False
    blocks = kv.block_ids(req.request_id)[: offer.num_blocks]
    connector.offer(req, blocks, offer.slot, offer.num_blocks * kv.block_size, offer.key)
    return True
