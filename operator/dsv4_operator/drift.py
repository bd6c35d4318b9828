"""Whether a live child already holds what the operator would apply, so a sync of an unchanged
deployment writes nothing.

Two checks, both needed: the hash annotation says the *desired* object has not changed since the
last apply (a field dropped from the desired object is only removed by applying again, and no
comparison of the live object can see that); ``covers`` says nobody edited a field we set
(drift, e.g. ``kubectl scale``). Fields the API server adds (defaults, status) are ignored.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from dsv4_operator.reconcile.names import DESIRED_HASH_ANNOTATION

# A List response's items carry no apiVersion/kind.
_TYPE_META = ("apiVersion", "kind")


def desired_hash(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` carrying the hash of its own content in an annotation (copied down to the
    annotations; everything else is shared with ``obj``)."""
    meta = obj["metadata"]
    annotations = {**meta.get("annotations", {}), DESIRED_HASH_ANNOTATION: desired_hash(obj)}
    return {**obj, "metadata": {**meta, "annotations": annotations}}


def _empty(value: Any) -> bool:
    # The API server omits empty strings, lists and maps, and false (Go's omitempty on a bool:
    # a Service's publishNotReadyAddresses).
    return value is None or value is False or value == "" or value == [] or value == {}


def covers(live: Any, want: Any) -> bool:
    """Every field of ``want`` is in ``live`` with an equal value; lists match item by item."""
    if isinstance(want, dict):
        if live is None:
            return all(_empty(v) for v in want.values())
        if not isinstance(live, dict):
            return False
        return all(covers(live[k], v) if k in live else _empty(v) for k, v in want.items())
    if isinstance(want, list):
        if live is None:
            return not want
        if not isinstance(live, list) or len(live) != len(want):
            return False
        return all(covers(a, b) for a, b in zip(live, want, strict=True))
    if isinstance(want, bool) or isinstance(live, bool):
        return live is want
    if isinstance(want, int | float) and isinstance(live, str):
        return live == str(want)  # a quantity written as a number comes back as a string
    return bool(live == want) or (_empty(want) and live is None)


def up_to_date(stamped: dict[str, Any], live: dict[str, Any]) -> bool:
    """Whether applying ``stamped`` (the output of ``stamp``) to ``live`` would change nothing."""
    want = stamped["metadata"]["annotations"][DESIRED_HASH_ANNOTATION]
    have = (live.get("metadata", {}).get("annotations") or {}).get(DESIRED_HASH_ANNOTATION)
    body = {k: v for k, v in stamped.items() if k not in _TYPE_META}
    return have == want and covers(live, body)
