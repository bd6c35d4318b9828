"""Same-host pulls copied by the engine's client into an extent its sidecar granted it: two
sidecars in this process (their control APIs on real sockets), the client as the engine uses
it. The first pull of a size goes through the sidecar and asks for a grant; the next ones are
copied here and adopted after; every way back to the sidecar's path (no grant that fits, a
trailer retired meanwhile, a sidecar that does not pull over shm) and every way a grant is
freed (its connection gone, given back for a larger pull) leaves the regions as they were."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsv4_kvtransfer.allocator import ExtentAllocator
from dsv4_kvtransfer.buffers import BufferSpec
from dsv4_kvtransfer.client import SidecarClient, SidecarError
from dsv4_kvtransfer.config import SidecarConfig
from dsv4_kvtransfer.control import ControlServer
from dsv4_kvtransfer.ledger import Ledger, LedgerError
from dsv4_kvtransfer.local_pull import MIN_GRANT_BYTES, grant_size
from dsv4_kvtransfer.metrics import SidecarMetrics
from dsv4_kvtransfer.pd_protocol import RemotePrefillParams
from dsv4_kvtransfer.sidecar import Sidecar
from dsv4_kvtransfer.staging import HEADER_BYTES, StagingRegion
from dsv4_kvtransfer.store import StagingStore

TOKEN = b"a-token-for-the-local-pull-unit-tests"
MB = 1 << 20


def until(what: str, cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@dataclass
class Node:
    sidecar: Sidecar
    control: ControlServer
    client: SidecarClient

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.control.port}"

    def usage(self) -> tuple[int, int]:
        u = self.sidecar.store.usage()
        return u.free_bytes, u.granted_bytes

    def close(self) -> None:
        self.client.close()
        self.control.stop()
        self.sidecar.stop()


@dataclass
class Pair:
    tmp: Path
    nodes: list[Node]

    def start(self, name: str, transport: str = "shm", staging: int = 16 * MB) -> Node:
        cfg = SidecarConfig(
            token=TOKEN,
            transport=transport,  # type: ignore[arg-type]
            host="127.0.0.1",
            port=0,
            control_port=0,
            staging_bytes=staging,
            shm_name=f"lp-{name}",
            shm_dir=str(self.tmp),
            sidecar_id=name,
            copy_threads=1,
            log_level="warning",
        )
        sc = Sidecar(cfg)
        sc.start()
        control = ControlServer(sc, "127.0.0.1", 0)
        control.start()
        node = Node(sc, control, SidecarClient(f"http://127.0.0.1:{control.port}"))
        self.nodes.append(node)
        return node


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path, [])
    try:
        yield p
    finally:
        for n in p.nodes:
            n.close()


def export(src: Node, payload: bytes, rid: str = "r1") -> RemotePrefillParams:
    res = src.client.reserve_export(
        rid, [BufferSpec("kv", "uint8", (len(payload),))], num_tokens=7, engine_meta={"t": 42}
    )
    with src.client.view(res.buffers["kv"]) as view:
        view[:] = payload
    return RemotePrefillParams.from_dict(src.client.commit_export(res.transfer_id))


def payload(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


def pull(dst: Node, params: RemotePrefillParams) -> tuple[str, bytes, dict[str, object]]:
    """-> (pull id, the bytes landed, remote meta); released after reading."""
    st = dst.client.start_pull(params, wait_s=5.0)
    kv = st.kv or dst.client.wait_pull(st.pull_id, 10)
    with dst.client.view(kv.buffers["kv"]) as view:
        got = bytes(view)
    dst.client.release_pull(kv.pull_id)
    dst.client.wait_adoptions()  # (a release of a pull copied here is answered later)
    return kv.pull_id, got, kv.remote_meta


def copies(node: Node) -> int:
    local = node.client._local_pull
    return local.copies if local is not None else 0


def test_the_second_pull_of_a_size_is_copied_by_the_client_and_adopted(pair: Pair) -> None:
    src, dst = pair.start("src", "tcp"), pair.start("dst")
    free_src, (free_dst, _) = src.sidecar.store.usage().free_bytes, dst.usage()
    data = payload(300_000, 1)
    _, got, _ = pull(dst, export(src, data, "r1"))  # through the sidecar; a grant asked after
    assert got == data and copies(dst) == 0
    for i in (2, 3):
        data = payload(300_000, i)
        params = export(src, data, f"r{i}")
        pull_id, got, meta = pull(dst, params)
        assert got == data and copies(dst) == i - 1
        assert meta["num_tokens"] == 7 and meta["engine_meta"] == {"t": 42}
        # the prefill side freed its export: RELEASE went after the adoption
        until("the export freed", lambda: src.sidecar.store.usage().free_bytes == free_src)
        assert dst.sidecar.puller.pulls.get(pull_id) is None  # released
    # what is left on the decode side: the grant for the next pull, nothing else
    free, granted = dst.usage()
    assert granted == grant_size(300_000) == MIN_GRANT_BYTES and free + granted == free_dst
    m = dst.sidecar.metrics.registry.get_sample_value
    until("the metrics", lambda: m("dsv4_kv_pulls_total", {"outcome": "done"}) == 3)
    received = {"direction": "received", "transport": "shm"}
    assert m("dsv4_kv_transfer_bytes_total", received) == 3 * 300_000
    # the client gone, its grant goes too
    dst.client.close()
    until("the grant freed", lambda: dst.usage() == (free_dst, 0))


def test_an_adopted_pull_is_a_pull_like_any_other_until_released(pair: Pair) -> None:
    src, dst = pair.start("src", "tcp"), pair.start("dst")
    pull(dst, export(src, payload(5000, 0), "r0"))  # the grant
    data = payload(5000, 1)
    st = dst.client.start_pull(export(src, data, "r1"), wait_s=5.0)
    assert st.kv is not None and copies(dst) == 1
    again = dst.client.poll_pull(st.pull_id)  # (the adoption answered first)
    assert again.kv is not None and again.kv.buffers == st.kv.buffers
    assert abs(again.kv.lease_expires_at - st.kv.lease_expires_at) < 1.0
    assert st.kv.lease_expires_at <= again.kv.lease_expires_at  # the client's never later
    with dst.client.view(st.kv.buffers["kv"]) as view:
        assert bytes(view) == data
    dst.client.release_pull(st.pull_id)
    dst.client.wait_adoptions()
    with pytest.raises(Exception, match="unknown pull"):
        dst.client.poll_pull(st.pull_id)


def test_a_pull_nobody_releases_is_adopted_within_a_second_and_then_leased(pair: Pair) -> None:
    src, dst = pair.start("src", "tcp"), pair.start("dst")
    pull(dst, export(src, payload(5000, 0), "r0"))
    params = export(src, payload(5000, 1), "r1")
    st = dst.client.start_pull(params, wait_s=5.0)
    assert st.kv is not None and copies(dst) == 1
    t = time.monotonic()
    assert st.pull_id not in dst.sidecar.puller.pulls  # not told yet
    until("the adoption", lambda: st.pull_id in dst.sidecar.puller.pulls, 6.0)
    assert time.monotonic() - t > 0.9  # (by the timer: FLUSH_S, checked every FLUSH_S / 2)
    pulled = dst.sidecar.puller.pulls[st.pull_id]
    assert pulled.state == "done" and pulled.expires_at is not None  # under a lease now
    tid = params.remote_transfer_id
    until("the export released", lambda: src.sidecar.store.export(tid) is None)
    dst.client.release_pull(st.pull_id)
    assert st.pull_id not in dst.sidecar.puller.pulls


def test_an_adoption_sent_just_before_the_client_closed_still_lands(pair: Pair) -> None:
    src, dst = pair.start("src", "tcp"), pair.start("dst")
    free_dst = dst.usage()[0]
    pull(dst, export(src, payload(5000, 0), "r0"))
    data = payload(5000, 2)
    st = dst.client.start_pull(export(src, data, "r1"), wait_s=5.0)
    assert st.kv is not None and copies(dst) == 1
    dst.client.close()  # the adoption's answer never read
    other = SidecarClient(dst.url)
    try:
        until("the adoption", lambda: st.pull_id in dst.sidecar.puller.pulls)
        kv = other.poll_pull(st.pull_id).kv
        assert kv is not None and kv.buffers == st.kv.buffers
        with other.view(kv.buffers["kv"]) as view:
            assert bytes(view) == data
        other.release_pull(st.pull_id)
    finally:
        other.close()
    until("everything freed", lambda: dst.usage() == (free_dst, 0))


def test_concurrent_pulls_through_one_client_land_exactly_and_free_everything(
    pair: Pair,
) -> None:
    src, dst = pair.start("src", "tcp", staging=32 * MB), pair.start("dst", staging=32 * MB)
    free_dst = dst.usage()[0]
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(12):
                data = payload(20_000 + 1000 * w, 10 * w + i)
                _, got, _ = pull(dst, export(src, data, f"w{w}-{i}"))
                assert got == data
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    dst.client.wait_adoptions()
    assert copies(dst) > 0  # some copied here, the others through the sidecar
    local = dst.client._local_pull
    assert local is not None and not local._pending and not local._copying
    free, granted = dst.usage()
    assert 0 < granted <= 4 * MIN_GRANT_BYTES and free + granted == free_dst
    assert dst.sidecar.store.usage().imports == 0


def test_a_larger_pull_gives_the_grant_back_and_the_next_one_fits(pair: Pair) -> None:
    src, dst = pair.start("src", "tcp"), pair.start("dst")
    pull(dst, export(src, payload(5000, 0), "r0"))
    assert dst.usage()[1] == MIN_GRANT_BYTES
    big = payload(3 * MB, 1)
    _, got, _ = pull(dst, export(src, big, "r1"))  # 1 MiB grant returned, the sidecar pulls
    assert got == big and copies(dst) == 0
    until("a grant of 4 MiB", lambda: dst.usage()[1] == 4 * MB)
    big = payload(3 * MB, 2)
    _, got, _ = pull(dst, export(src, big, "r2"))
    assert got == big and copies(dst) == 1
    _, got, _ = pull(dst, export(src, payload(100, 3), "r3"))  # a small one fits the big grant
    assert got == payload(100, 3) and copies(dst) == 2


def test_a_trailer_retired_during_the_copy_falls_back_and_keeps_the_grant(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = pair.start("src", "tcp"), pair.start("dst")
    pull(dst, export(src, payload(5000, 0), "r0"))
    data = payload(5000, 1)
    params = export(src, data, "r1")
    local = dst.client._local_pull
    assert local is not None
    copy = local._copy.copy

    def retired_meanwhile(d: memoryview, s: memoryview) -> None:
        copy(d, s)
        exp = src.sidecar.store.export(params.remote_transfer_id)
        assert exp is not None
        src.sidecar.store.region.retire(exp.offset + exp.layout.total_bytes)

    monkeypatch.setattr(local._copy, "copy", retired_meanwhile)
    _, got, _ = pull(dst, params)  # the sidecar asked the peer (MANIFEST_REQ, SHM_MAP)
    assert got == data and copies(dst) == 0
    assert len(local._grants) == 1  # kept for the next pull


def test_a_sidecar_that_pulls_over_tcp_grants_nothing(pair: Pair) -> None:
    src, dst = pair.start("src", "tcp"), pair.start("dst", "tcp")
    free_dst = dst.usage()[0]
    for i in range(3):
        data = payload(5000, i)
        _, got, _ = pull(dst, export(src, data, f"r{i}"))
        assert got == data
    assert dst.client._local_pull is None and dst.usage() == (free_dst, 0)
    with pytest.raises(SidecarError) as e:  # asked all the same: refused
        dst.client.request("POST", "/v1/grants", {"bytes": 4096})
    assert (e.value.status, e.value.code) == (409, "unsupported")


def test_in_place_off_and_pulls_without_a_wait_go_through_the_sidecar(pair: Pair) -> None:
    src, dst = pair.start("src", "tcp"), pair.start("dst")
    off = SidecarClient(dst.url, in_place=False)
    try:
        for i in range(2):
            st = off.start_pull(export(src, payload(5000, i), f"r{i}"), wait_s=5.0)
            assert st.kv is not None
            off.release_pull(st.pull_id)
        assert off._local_pull is None
    finally:
        off.close()
    for i in range(2, 4):  # wait_s=0: the caller polls, the sidecar pulls
        st = dst.client.start_pull(export(src, payload(5000, i), f"r{i}"))
        dst.client.wait_pull(st.pull_id, 10)
        dst.client.release_pull(st.pull_id)
    assert copies(dst) == 0 and dst.usage()[1] == 0


def test_grants_over_http_or_on_another_connection_are_refused(pair: Pair) -> None:
    dst = pair.start("dst")
    http = SidecarClient(dst.url, fast=False)
    try:
        with pytest.raises(Exception, match="no route"):
            http.request("POST", "/v1/grants", {"bytes": 4096})
    finally:
        http.close()
    got = dst.client.request("POST", "/v1/grants", {"bytes": 4096})  # a pooled connection
    # adopting it on another connection: refused, the grant stays its connection's
    other = SidecarClient(dst.url)
    try:
        with pytest.raises(Exception, match="no grant"):
            other.request("POST", f"/v1/grants/{got['grant_id']}/adopt", {})
    finally:
        other.close()
    assert dst.usage()[1] == 4096
    for bad in (0, MB * 65, "x"):
        with pytest.raises(Exception, match="bytes must be"):
            dst.client.request("POST", "/v1/grants", {"bytes": bad})


def test_the_store_accounts_grants_apart_and_adopts_only_a_grant(tmp_path: Path) -> None:
    region = StagingRegion.create("lp-store", 1 << 20, tmp_path)
    store = StagingStore(
        region, Ledger(ExtentAllocator(HEADER_BYTES, (1 << 20) - HEADER_BYTES)), SidecarMetrics()
    )
    try:
        total = store.usage().free_bytes
        g = store.grant("g1", 10_000)
        assert (g.offset, g.capacity) == (HEADER_BYTES, 12288)
        u = store.usage()
        assert (u.free_bytes, u.granted_bytes, u.imports) == (total - 12288, 12288, 0)
        with pytest.raises(ValueError):
            store.adopt("g1", 12289, 30.0)  # larger than the grant: it stays one
        assert store.usage().granted_bytes == 12288
        store.clock = lambda: 100.0
        assert store.adopt("g1", 10_000, 30.0) == (HEADER_BYTES, 130.0)
        u = store.usage()
        assert (u.granted_bytes, u.imports) == (0, 1)
        assert not store.drop_grant("g1")  # a pull now: only its release frees it
        with pytest.raises(ValueError):
            store.adopt("g1", 10_000, 30.0)
        assert [f.key for f in store.sweep()] == []
        store.clock = lambda: 131.0
        assert [(f.key, f.reason) for f in store.sweep()] == [("g1", "expired")]
        store.grant("g2", 4096)
        assert store.drop_grant("g2") and store.usage().free_bytes == total
        with pytest.raises(LedgerError):
            store.grant("g3", 2 << 20)
    finally:
        region.close()


def test_a_region_attached_by_two_pulls_at_once_stays_mapped_for_both(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two first pulls from one sidecar both attach its region; the second to finish must not
    unmap the first's mapping while the first reads it (it did: 'operation forbidden on
    released memoryview object' under load)."""
    import dsv4_kvtransfer.local_pull as lp
    from dsv4_kvtransfer.pd_protocol import shm_source

    src, dst = pair.start("src", "tcp"), pair.start("dst")
    pull(dst, export(src, payload(5000, 0), "warm-up"))  # the client's local puller exists
    local = dst.client._local_pull
    assert local is not None
    where = shm_source(export(src, payload(5000, 1), "r1").extra)
    assert where is not None
    local._sources.clear()
    attach = StagingRegion.attach
    inner: list[StagingRegion | None] = []
    calls = []

    def attach_while_another_pull_attaches(*a: object, **kw: object) -> StagingRegion:
        region = attach(*a, **kw)  # type: ignore[arg-type]
        calls.append(1)
        if len(calls) == 1:
            inner.append(local._source(where))  # the other pull, in between
        return region

    monkeypatch.setattr(lp.StagingRegion, "attach", attach_while_another_pull_attaches)
    outer = local._source(where)
    assert outer is not None and outer is inner[0] is local._sources[where.name]
    assert len(bytes(outer.view(HEADER_BYTES, 16))) == 16  # still mapped
