"""Integrity on every pull path, two sidecars in this process and the engine's client: the
checksums an export's commit computes travel in its manifest; a byte changed in the source's
staging after the commit fails the pull with ``checksum_mismatch`` whether the client copies it
(a grant), the decode sidecar copies it in place (shm) or it comes over TCP; an export of
another KV layout fails with ``fingerprint_mismatch`` before a byte moves. Nothing of a failed
pull is left on the decode side, and the failures are counted by reason."""

from __future__ import annotations

import pytest

from dsv4_kvtransfer.buffers import BufferSpec
from dsv4_kvtransfer.client import PullFailed
from dsv4_kvtransfer.integrity import Fingerprint, ParallelLayout, checksum
from dsv4_kvtransfer.pd_protocol import RemotePrefillParams
from tests.unit.kvtransfer.test_local_pull import Node, Pair, copies, pair, payload, until

__all__ = ["pair"]  # the fixture

pytestmark = pytest.mark.unit

FP = Fingerprint("DeepseekV4ForCausalLM", "bfloat16", 128, {"comp4": "0" * 12}, revision="r1")


def export(
    src: Node, data: bytes, rid: str, fingerprint: Fingerprint | None = FP
) -> tuple[RemotePrefillParams, memoryview]:
    """An export of ``data`` in two buffers, and a writable view of it (to corrupt)."""
    half = len(data) // 2
    specs = [BufferSpec("a", "uint8", (half,)), BufferSpec("b", "uint8", (len(data) - half,))]
    res = src.client.reserve_export(rid, specs, num_tokens=7, fingerprint=fingerprint)
    with src.client.view(res.buffers["a"]) as va, src.client.view(res.buffers["b"]) as vb:
        va[:], vb[:] = data[:half], data[half:]
    params = RemotePrefillParams.from_dict(src.client.commit_export(res.transfer_id))
    return params, src.client.view(res.buffers["b"])


def failures(node: Node, reason: str) -> float:
    m = node.sidecar.metrics.registry.get_sample_value
    return m("dsv4_kv_pull_failures_total", {"reason": reason}) or 0.0


def failed_pull(dst: Node, params: RemotePrefillParams, fp: Fingerprint | None = FP) -> str:
    with pytest.raises(PullFailed) as e:
        st = dst.client.start_pull(params, wait_s=5.0, fingerprint=fp)
        dst.client.wait_pull(st.pull_id, 10)
    if e.value.pull_id:
        dst.client.release_pull(e.value.pull_id)
    return str(e.value.reason)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_byte_changed_after_the_commit_fails_the_pull(pair: Pair, transport: str) -> None:
    src, dst = pair.start("src", "tcp"), pair.start("dst", transport)
    free_src, free_dst = src.sidecar.store.usage().free_bytes, dst.usage()[0]
    data = payload(300_000, 1)
    params, _ = export(src, data, "r0")
    _, got, meta = pull_as(dst, params, FP)  # intact: lands (and, over shm, asks for a grant)
    assert got == data
    record = meta["integrity"]
    assert isinstance(record, dict)
    assert record["checksums"] == {"a": checksum(data[:150_000]), "b": checksum(data[150_000:])}
    assert record["fingerprint"] == FP.to_dict()
    for i in (1, 2):  # over shm: the client refuses its copy, the sidecar fails its own
        params, view = export(src, payload(300_000, i), f"r{i}")
        view[1000] ^= 0x40
        before = copies(dst)
        assert failed_pull(dst, params) == "checksum_mismatch"
        assert copies(dst) == before  # never handed out
        assert failures(dst, "checksum_mismatch") == i
        src.client.abort_export(params.remote_transfer_id)
    dst.client.close()
    until("the decode side freed", lambda: dst.usage() == (free_dst, 0))
    until("the exports freed", lambda: src.sidecar.store.usage().free_bytes == free_src)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_export_of_another_layout_is_refused_before_a_byte_moves(
    pair: Pair, transport: str
) -> None:
    src, dst = pair.start("src", "tcp"), pair.start("dst", transport)
    free_dst = dst.usage()[0]
    data = payload(200_000, 3)
    params, _ = export(src, data, "r0")
    pull_as(dst, params, FP)  # (a grant for the next ones, over shm)
    registry = dst.sidecar.metrics.registry
    # a landed pull is counted after its answer: wait for it, the failed ones must add nothing
    until(
        "the pull counted",
        lambda: registry.get_sample_value("dsv4_kv_pulls_total", {"outcome": "done"}) == 1,
    )
    other_rev = Fingerprint(FP.model, FP.dtype, FP.block_size, FP.cache_groups, revision="r2")
    tp2 = Fingerprint(FP.model, FP.dtype, FP.block_size, FP.cache_groups, ParallelLayout(1, 2))
    for i, (theirs, mine) in enumerate([(FP, other_rev), (FP, tp2), (None, FP)]):
        params, _ = export(src, data, f"r{i + 1}", fingerprint=theirs)
        received = dst.sidecar.metrics.registry.get_sample_value(
            "dsv4_kv_transfer_bytes_total", {"direction": "received", "transport": transport}
        )
        assert failed_pull(dst, params, mine) == "fingerprint_mismatch"
        assert failures(dst, "fingerprint_mismatch") == i + 1
        assert (
            dst.sidecar.metrics.registry.get_sample_value(
                "dsv4_kv_transfer_bytes_total", {"direction": "received", "transport": transport}
            )
            == received
        )
        # the same export pulled by an engine of its layout (or one that names none) lands
        _, got, _ = pull_as(dst, params, theirs)
        assert got == data
    dst.client.close()
    until("the decode side freed", lambda: dst.usage() == (free_dst, 0))


def pull_as(
    dst: Node, params: RemotePrefillParams, fp: Fingerprint | None
) -> tuple[str, bytes, dict[str, object]]:
    st = dst.client.start_pull(params, wait_s=5.0, fingerprint=fp)
    kv = st.kv or dst.client.wait_pull(st.pull_id, 10)
    got = b""
    for name in ("a", "b"):
        with dst.client.view(kv.buffers[name]) as view:
            got += bytes(view)
    dst.client.release_pull(kv.pull_id)
    dst.client.wait_adoptions()
    return kv.pull_id, got, kv.remote_meta


def test_a_bad_fingerprint_in_a_request_is_a_400_naming_it(pair: Pair) -> None:
    src = pair.start("src", "tcp")
    with pytest.raises(Exception, match="fingerprint") as e:
        src.client.request(
            "POST",
            "/v1/exports",
            {
                "request_id": "r",
                "buffers": [{"name": "a", "dtype": "uint8", "shape": [4]}],
                "fingerprint": {"v": 1, "model": "m"},
            },
        )
    assert getattr(e.value, "status", None) == 400
