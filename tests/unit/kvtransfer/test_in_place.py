"""Same-host pulls without a round trip before the copy: exports published with a trailer (the
owner writes it at commit and clears its marker before the export stops being pullable), the
shm puller copying from the params' place and checking the trailer after, and every way back
to asking the peer (no trailer, a retired one, one retired during the copy)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsv4_kvtransfer.allocator import ExtentAllocator
from dsv4_kvtransfer.buffers import BufferSpec, Layout
from dsv4_kvtransfer.config import SidecarConfig
from dsv4_kvtransfer.control_requests import PullRequest
from dsv4_kvtransfer.ledger import Ledger
from dsv4_kvtransfer.metrics import SidecarMetrics
from dsv4_kvtransfer.pd_protocol import SHM_SOURCE, RemotePrefillParams, shm_source
from dsv4_kvtransfer.peer import MAX_OWED
from dsv4_kvtransfer.peer_server import PeerServer, PeerServerConfig
from dsv4_kvtransfer.puller import Puller
from dsv4_kvtransfer.staging import HEADER_BYTES, TRAILER, StagingRegion
from dsv4_kvtransfer.store import StagingStore, manifest_bytes
from dsv4_kvtransfer.transports import make_transport
from dsv4_kvtransfer.transports.base import DirectSource
from dsv4_kvtransfer.transports.shm import ShmTransport

TOKEN = b"a-token-for-the-in-place-unit-tests"
REGION = 1 << 20
PAYLOAD = bytes(range(256)) * 39 + b"0123456789abcdef"  # 10,000 bytes


def make_store(tmp: Path, name: str, publish: bool) -> StagingStore:
    region = StagingRegion.create(name, REGION, tmp)
    ledger = Ledger(ExtentAllocator(HEADER_BYTES, REGION - HEADER_BYTES))
    return StagingStore(region, ledger, SidecarMetrics(), publish=publish)


def sample(store: StagingStore, name: str, **labels: str) -> float:
    return store.metrics.registry.get_sample_value(name, labels) or 0.0


def until(what: str, cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@dataclass
class Peers:
    tmp: Path
    src: StagingStore
    dst: StagingStore
    server: PeerServer
    port: int
    frames: list[str]
    pullers: list[Puller]

    def puller(self, transport: ShmTransport | None = None) -> Puller:
        cfg = SidecarConfig(token=TOKEN, sidecar_id="dst", lease_seconds=30.0)
        t = transport or make_transport("shm", shm_dir=str(self.tmp), copy_threads=1)
        p = Puller(self.dst, t, cfg, self.dst.metrics)
        self.pullers.append(p)
        return p

    def export(self, tid: str, payload: bytes = PAYLOAD) -> RemotePrefillParams:
        """A committed export holding ``payload`` and its params, as the sidecar writes them."""
        layout = Layout.plan([BufferSpec("kv", "uint8", (len(payload),))])
        exp = self.src.reserve_export(tid, layout, {"request_id": "r1"}, ttl=30.0)
        with self.src.region.view(exp.offset, len(payload)) as view:
            view[:] = payload
        self.src.commit_export(tid, ttl=30.0)
        region = self.src.region
        return RemotePrefillParams(
            remote_engine_id="e",
            remote_request_id="r1",
            remote_block_ids=(),
            remote_host="127.0.0.1",
            remote_port=self.port,
            remote_transfer_id=tid,
            remote_lease_expires_at=time.time() + 30,
            remote_num_tokens=1,
            remote_total_bytes=len(payload),
            extra={
                SHM_SOURCE: {"name": region.name, "tag": region.tag.hex(), "offset": exp.offset}
            },
        )


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[Peers]:
    src, dst = make_store(tmp_path, "src", True), make_store(tmp_path, "dst", True)
    server = PeerServer(
        PeerServerConfig(host="127.0.0.1", port=0, server_id="src", token=TOKEN),
        src,
        src.metrics,
    )
    frames: list[str] = []
    dispatch = server._dispatch

    def noted(sock, state, frame):  # type: ignore[no-untyped-def]
        frames.append(frame.type.name)
        return dispatch(sock, state, frame)

    server._dispatch = noted  # type: ignore[method-assign]
    p = Peers(tmp_path, src, dst, server, server.start(), frames, [])
    try:
        yield p
    finally:
        for puller in p.pullers:
            puller.stop()
        server.stop()
        src.region.close()
        dst.region.close()


def test_an_export_is_published_at_commit_and_retired_before_it_goes(tmp_path: Path) -> None:
    store = make_store(tmp_path, "pub", True)
    layout = Layout.plan([BufferSpec("kv", "uint8", (10_000,))])
    manifest = manifest_bytes(layout, {"request_id": "r1"})
    exp = store.reserve_export("t1", layout, {"request_id": "r1"}, ttl=30.0)
    assert exp.trailer == TRAILER.size + len(manifest)
    # 10,000 bytes and the trailer: still three 4 KiB units
    assert store.ledger.exports["t1"].capacity == 12_288
    at = exp.offset + 10_000
    assert store.region.trailer(at, "t1") is None  # reserved: not pullable yet
    store.commit_export("t1", ttl=30.0)
    trailer = store.region.trailer(at, "t1")
    assert trailer is not None and trailer.manifest == manifest and trailer.intact()
    assert store.region.trailer(at, "t2") is None  # another id never matches
    # pinned by a reader and released: no longer pullable, so retired before it is freed
    store.pin_export("t1")
    store.release_export("t1")
    assert "t1" in store.ledger.exports and not trailer.intact()
    assert store.region.trailer(at, "t1") is None
    store.unpin_export("t1")
    assert store.ledger.exports == {}
    for how in ("abort", "expire"):
        exp = store.reserve_export(how, layout, {}, ttl=1.0)
        store.commit_export(how, ttl=1.0)
        t = store.region.trailer(exp.offset + 10_000, how)
        assert t is not None and t.intact()
        if how == "abort":
            store.abort_export(how)
        else:
            store.clock = lambda: time.monotonic() + 5.0
            assert [f.key for f in store.sweep()] == [how]
        assert not t.intact()
    store.region.close()


def test_a_store_that_does_not_publish_reserves_no_trailer(tmp_path: Path) -> None:
    store = make_store(tmp_path, "plain", False)
    exp = store.reserve_export("t1", Layout.plan([BufferSpec("kv", "uint8", (4096,))]), {}, 30.0)
    assert exp.trailer == 0 and store.ledger.exports["t1"].capacity == 4096
    store.commit_export("t1", ttl=30.0)
    assert store.region.trailer(exp.offset + 4096, "t1") is None
    store.region.close()


def test_shm_source_takes_only_a_well_formed_place() -> None:
    good = {"name": "dsv4-kv-1", "tag": "0" * 32, "offset": 4096}
    assert shm_source({SHM_SOURCE: good}) is not None
    for bad in (
        None,
        "x",
        {**good, "name": "../etc"},
        {**good, "tag": "xyz"},
        {**good, "offset": -1},
        {**good, "offset": True},
    ):
        assert shm_source({SHM_SOURCE: bad}) is None


def test_a_same_host_pull_copies_without_a_round_trip_and_releases_after(peers: Peers) -> None:
    puller = peers.puller()
    st = puller.start(PullRequest(peers.export("t1"), wait_s=5.0))
    assert st["state"] == "done" and st["remote_meta"] == {"request_id": "r1"}
    with peers.dst.region.view(st["offset"], len(PAYLOAD)) as got:
        assert bytes(got) == PAYLOAD
    # nothing asked before the answer; RELEASE after it, once: the source frees its export
    until("the export released", lambda: not peers.src.ledger.exports)
    assert peers.frames == ["RELEASE"]
    assert sample(peers.src, "dsv4_kv_released_total", kind="export", reason="pulled") == 1
    until("the pull counted", lambda: sample(peers.dst, "dsv4_kv_pulls_total", outcome="done"))
    assert sample(
        peers.dst, "dsv4_kv_transfer_bytes_total", direction="received", transport="shm"
    ) == len(PAYLOAD)
    # the next one reuses the pooled connection for its RELEASE
    st2 = puller.start(PullRequest(peers.export("t2"), wait_s=5.0))
    assert st2["state"] == "done"
    assert len(puller._layouts) == 1  # the same shapes: parsed once
    until("the second export released", lambda: not peers.src.ledger.exports)
    assert peers.frames == ["RELEASE", "RELEASE"]
    assert sample(peers.src, "dsv4_kv_released_total", kind="export", reason="pulled") == 2
    for pid in (st["pull_id"], st2["pull_id"]):
        assert puller.release(pid)["freed"]
    assert peers.dst.ledger.alloc.free_bytes == REGION - HEADER_BYTES
    assert sample(peers.dst, "dsv4_kv_released_total", kind="import", reason="aborted") == 0


def test_without_a_readable_trailer_the_pull_asks_the_peer(peers: Peers) -> None:
    puller = peers.puller()
    params = peers.export("t1")
    src = shm_source(params.extra)
    assert src is not None
    peers.src.region.retire(src.offset + len(PAYLOAD))  # as if never published
    st = puller.start(PullRequest(params, wait_s=5.0))
    assert st["state"] == "done"
    with peers.dst.region.view(st["offset"], len(PAYLOAD)) as got:
        assert bytes(got) == PAYLOAD
    until("the export released", lambda: not peers.src.ledger.exports)
    assert peers.frames == ["MANIFEST_REQ", "SHM_MAP", "RELEASE"]
    assert puller.release(st["pull_id"])["freed"]
    # an export gone before the pull: its trailer is retired, the peer says unknown_transfer
    params = peers.export("t2")
    peers.src.abort_export("t2")
    st = puller.start(PullRequest(params, wait_s=5.0))
    assert (st["state"], st["reason"]) == ("failed", "unknown_transfer")
    assert peers.dst.ledger.imports == {}


class RetiredMidCopy(ShmTransport):
    """The source's export is aborted while the copy runs (its lease ran out, say)."""

    def __init__(self, shm_dir: str, src: StagingStore) -> None:
        super().__init__(shm_dir, copy_threads=1)
        self.src = src

    def direct_source(self, params: RemotePrefillParams) -> DirectSource | None:
        inner = super().direct_source(params)
        assert inner is not None
        store, tid = self.src, params.remote_transfer_id

        class Aborting(DirectSource):
            def trailer(self):  # type: ignore[no-untyped-def]
                return inner.trailer()

            def copy_into(self, dest: memoryview, deadline: float) -> None:
                store.abort_export(tid)
                inner.copy_into(dest, deadline)

        return Aborting()


def test_a_trailer_retired_during_the_copy_discards_the_copy(peers: Peers) -> None:
    puller = peers.puller(RetiredMidCopy(str(peers.tmp), peers.src))
    st = puller.start(PullRequest(peers.export("t1"), wait_s=5.0))
    # the copy is not trusted: the peer is asked, and the export is gone
    assert (st["state"], st["reason"]) == ("failed", "unknown_transfer")
    assert peers.frames[:1] == ["MANIFEST_REQ"]
    assert peers.dst.ledger.imports == {}
    assert peers.dst.ledger.alloc.free_bytes == REGION - HEADER_BYTES


def test_a_region_that_is_not_here_is_not_looked_for_again_at_once(peers: Peers) -> None:
    shm = ShmTransport(str(peers.tmp), copy_threads=1)
    params = peers.export("t1")
    elsewhere = {**params.extra[SHM_SOURCE], "name": "not-on-this-host"}
    moved = dataclasses.replace(params, extra={SHM_SOURCE: elsewhere})
    assert shm.direct_source(moved) is None
    assert ("not-on-this-host", elsewhere["tag"]) in shm._absent
    assert shm.direct_source(params) is not None
    shm.close()


def test_after_the_answer_release_goes_out_without_waiting_and_its_answer_is_read_later(
    peers: Peers, caplog: pytest.LogCaptureFixture
) -> None:
    puller = peers.puller()
    after: list[Callable[[], None]] = []
    st = puller.start(PullRequest(peers.export("t1"), wait_s=5.0), after=after)
    assert st["state"] == "done" and len(after) == 1
    assert "t1" in peers.src.ledger.exports  # nothing sent before the answer
    after[0]()  # no pooled connection yet: RELEASE on the pool (connect, release)
    until("the export released", lambda: not peers.src.ledger.exports)
    until("the connection pooled", lambda: bool(puller._pool.get(("127.0.0.1", peers.port))))
    # the next one: RELEASE on the pooled connection, on this thread, its answer not awaited
    after.clear()
    st2 = puller.start(PullRequest(peers.export("t2"), wait_s=5.0), after=after)
    after[0]()
    until("the second export released", lambda: not peers.src.ledger.exports)
    ((_, conn),) = puller._pool[("127.0.0.1", peers.port)]
    assert conn._owed == ["t2"]
    # an answer owed is read before the next reply, an error in it only logged
    params = peers.export("t3")
    conn.release_nowait("t2")  # released already: the source answers with an error
    assert conn.manifest("t3")["layout"]["total_bytes"] == len(PAYLOAD)
    assert conn._owed == [] and "releasing transfer t2 failed" in caplog.text
    assert params.remote_transfer_id == "t3"
    for pid in (st["pull_id"], st2["pull_id"]):
        assert puller.release(pid)["freed"]


def test_answers_owed_do_not_pile_up_on_a_connection_that_only_releases(peers: Peers) -> None:
    puller = peers.puller()
    conn = puller._connect("127.0.0.1", peers.port)
    try:
        conn.settimeout(5.0)
        for i in range(MAX_OWED + 3):
            peers.export(f"t{i}")
            conn.release_nowait(f"t{i}")
            # read by the MAX_OWED-th at the latest, so never more than MAX_OWED - 1 left
            assert len(conn._owed) == (i + 1) % MAX_OWED
        until("every export released", lambda: not peers.src.ledger.exports)
    finally:
        conn.close()
