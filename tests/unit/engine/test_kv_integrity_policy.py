"""Pulled KV refused by its integrity check: the engine's fingerprint (``KVCompat`` with the
cache's rows) and the policy for ``fingerprint_mismatch`` / ``checksum_mismatch`` (recompute,
whatever ``--kv-failure-policy``, counted by reason)."""

from __future__ import annotations

import pytest

from dsv4_kvtransfer.integrity import ParallelLayout
from dsv4_serving.engine.kv_connector.compat import KVCompat
from dsv4_serving.engine.kv_connector.metadata import KVConnectorOutput, KVTransferFailure
from tests.unit.engine.test_kv_connector_scheduler import REMOTE, make, req

pytestmark = pytest.mark.unit

ROWS = [
    ("layers.0.comp", "comp4", "float32", (4, 64)),
    ("layers.0.window", "window", "float32", (130, 64)),
]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("reason", ["checksum_mismatch", "fingerprint_mismatch"])
def test_integrity_failures_recompute_under_either_policy(policy: str, reason: str) -> None:
    s, _ = make(policy)
    s.add_request(req("d", 10, REMOTE))
    s.schedule()
    s.update_from_connector(KVConnectorOutput(failed={"d": KVTransferFailure(reason, "x")}))
    out = s.schedule()
    assert out.scheduled[0].context_len == 0 and len(out.scheduled[0].token_ids) == 10
    stats = s.connector.stats  # type: ignore[union-attr]
    assert (stats.recomputes, stats.pull_failures) == (1, {reason: 1})
    assert s.take_extra_outputs() == []


def test_other_failures_still_follow_the_policy() -> None:
    assert KVTransferFailure("checksum_mismatch", "x").always_recomputes
    assert not KVTransferFailure("auth", "x").always_recomputes
    assert not KVTransferFailure("incompatible", "x").always_recomputes


def test_the_engine_fingerprint() -> None:
    mine = KVCompat("DeepseekV4ForCausalLM", 16, 1, "float32", "rev-a")
    fp = mine.fingerprint(ROWS, ParallelLayout())
    assert (fp.model, fp.dtype, fp.block_size, fp.revision) == (
        "DeepseekV4ForCausalLM",
        "float32",
        16,
        "rev-a",
    )
    assert sorted(fp.cache_groups) == ["comp4", "window"]
    assert mine.fingerprint(list(reversed(ROWS)), ParallelLayout()).digest == fp.digest
    other = KVCompat("DeepseekV4ForCausalLM", 16, 1, "float32", "rev-b")
    assert other.fingerprint(ROWS, ParallelLayout()).diff(fp) == ["revision"]
    longer_ring = [ROWS[0], ("layers.0.window", "window", "float32", (131, 64))]
    assert mine.fingerprint(longer_ring, ParallelLayout()).diff(fp) == ["cache_groups"]
    assert mine.fingerprint(ROWS, ParallelLayout(0, 2)).diff(fp) == ["parallel"]
    # the revision is the fingerprint's only: the params the edge checks do not change
    assert mine.params_extra([1, 2]) == other.params_extra([1, 2])
