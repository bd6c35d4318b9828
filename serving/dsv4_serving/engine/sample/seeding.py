"""Seeded sampling by position: a seeded request's draws for the token at output position
``i`` come from a generator seeded with ``position_seed(seed, i)``, reseeded for every position
(a step verifying MTP drafts reseeds per row: ``sampler.sample_and_verify``), so its tokens
are a function of (seed, position, logits) alone, whatever drafts a step had. A stream
continued on another engine (``entrypoints/continuation.py``) after ``k`` tokens is sent the
seed ``position_seed(seed, k)``: its output position 0 draws what the first engine's position
``k`` would have, so a seeded answer survives the move as a greedy one does, with MTP on or
off. (The generator state that moves is only the seed: nothing else is carried.)"""

from __future__ import annotations

_MOD = 2**63
_STRIDE = 0x9E3779B97F4A7C15 % _MOD  # odd: positions map to distinct seeds
# (n > 1 gives sample i the seed ``seed + i``: its positions stay apart from sample 0's)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of output position ``position`` of a request seeded ``seed``;
    ``position_seed(position_seed(s, a), b) == position_seed(s, a + b)``."""
    return (seed + position * _STRIDE) % _MOD
