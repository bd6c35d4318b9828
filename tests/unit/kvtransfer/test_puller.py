"""The puller against a real peer server on loopback, in one process: each pull's status, the
decode side's ledger and the bytes and frees it accounts, for a pull that lands, one whose data
path fails, one of an unknown transfer and one the engine gives up on while it runs; a small
pull asked with a wait on the asking thread, its data request sent with the manifest's."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsv4_kvtransfer.allocator import ExtentAllocator
from dsv4_kvtransfer.buffers import BufferSpec, Layout
from dsv4_kvtransfer.config import SidecarConfig
from dsv4_kvtransfer.control_requests import PullRequest
from dsv4_kvtransfer.errors import ApiError
from dsv4_kvtransfer.ledger import Import, Ledger
from dsv4_kvtransfer.metrics import SidecarMetrics
from dsv4_kvtransfer.pd_protocol import RemotePrefillParams
from dsv4_kvtransfer.peer import PeerConnection
from dsv4_kvtransfer.peer_server import PeerServer, PeerServerConfig
from dsv4_kvtransfer.puller import Puller
from dsv4_kvtransfer.staging import HEADER_BYTES, StagingRegion
from dsv4_kvtransfer.store import StagingStore
from dsv4_kvtransfer.transports import FetchJob, TransferFailed, Transport, make_transport

TOKEN = b"a-token-for-the-puller-unit-tests"
REGION = 1 << 20
NBYTES = 10_000  # -> a 12 KiB extent (3 units of 4 KiB)
EXTENT = 12_288


def make_store(tmp: Path, name: str) -> StagingStore:
    region = StagingRegion.create(name, REGION, tmp)
    ledger = Ledger(ExtentAllocator(HEADER_BYTES, REGION - HEADER_BYTES))
    return StagingStore(region, ledger, SidecarMetrics())


def sample(store: StagingStore, name: str, **labels: str) -> float:
    return store.metrics.registry.get_sample_value(name, labels) or 0.0


class Blocking(Transport):
    """Lands nothing until released, then fails or delegates (a pull the test can catch
    mid-flight)."""

    name = "blocking"

    def __init__(self, then: Callable[[FetchJob], None]) -> None:
        self.started = threading.Event()
        self.go = threading.Event()
        self.then = then

    def fetch(self, job: FetchJob) -> None:
        self.started.set()
        assert self.go.wait(10)
        self.then(job)


def fail_protocol(job: FetchJob) -> None:
    raise TransferFailed("protocol", "the bytes came back wrong")


@dataclass
class Peers:
    src: StagingStore
    dst: StagingStore
    server: PeerServer
    port: int
    pullers: list[Puller]

    def puller(self, transport: Transport | None = None) -> Puller:
        cfg = SidecarConfig(token=TOKEN, sidecar_id="dst", lease_seconds=30.0)
        p = Puller(self.dst, transport or make_transport("tcp", streams=1), cfg, self.dst.metrics)
        self.pullers.append(p)
        return p

    def export(self, tid: str, payload: bytes) -> RemotePrefillParams:
        """An export on the source holding ``payload``, committed, and the params naming it."""
        layout = Layout.plan([BufferSpec("kv", "uint8", (len(payload),))])
        exp = self.src.reserve_export(tid, layout, {"request_id": "r1"}, ttl=30.0)
        with self.src.region.view(exp.offset, len(payload)) as view:
            view[:] = payload
        self.src.commit_export(tid, ttl=30.0)
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
        )


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[Peers]:
    src, dst = make_store(tmp_path, "src"), make_store(tmp_path, "dst")
    server = PeerServer(
        PeerServerConfig(host="127.0.0.1", port=0, server_id="src", token=TOKEN),
        src,
        src.metrics,
    )
    p = Peers(src, dst, server, server.start(), [])
    try:
        yield p
    finally:
        for puller in p.pullers:
            puller.stop()
        server.stop()
        src.region.close()
        dst.region.close()


def until(what: str, cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


PAYLOAD = bytes(range(256)) * 39 + b"0123456789abcdef"  # 10,000 bytes
assert len(PAYLOAD) == NBYTES


def test_a_pull_lands_the_bytes_holds_the_extent_under_a_lease_and_frees_both_sides(
    peers: Peers,
) -> None:
    puller = peers.puller()
    params = peers.export("t1", PAYLOAD)
    st = puller.start(PullRequest(params, wait_s=5.0))
    pid = st["pull_id"]
    assert st["state"] == "done"
    assert (st["bytes_done"], st["total_bytes"], st["offset"]) == (NBYTES, NBYTES, HEADER_BYTES)
    assert st["buffers"] == [
        {
            "name": "kv",
            "dtype": "uint8",
            "shape": [NBYTES],
            "group": "",
            "offset": HEADER_BYTES,
            "nbytes": NBYTES,
        }
    ]
    assert st["remote_meta"] == {"request_id": "r1"}
    imp = peers.dst.ledger.imports[pid]
    assert (imp.pull_id, imp.offset, imp.capacity, imp.nbytes) == (
        pid,
        HEADER_BYTES,
        EXTENT,
        NBYTES,
    )
    assert imp.expires_at is not None
    with peers.dst.region.view(HEADER_BYTES, NBYTES) as got:
        assert bytes(got) == PAYLOAD
    # an inline pull's metrics are recorded right after its answer, off the engine's path
    until("the pull counted", lambda: sample(peers.dst, "dsv4_kv_pulls_total", outcome="done") == 1)
    assert (
        sample(peers.dst, "dsv4_kv_transfer_bytes_total", direction="received", transport="tcp")
        == NBYTES
    )
    assert sample(peers.dst, "dsv4_kv_staging_free_bytes") == REGION - HEADER_BYTES - EXTENT
    # the puller sent RELEASE: the source freed its export as pulled
    until("the export freed", lambda: not peers.src.ledger.exports)
    assert sample(peers.src, "dsv4_kv_released_total", kind="export", reason="pulled") == 1

    assert puller.release(pid) == {"pull_id": pid, "freed": True}
    assert peers.dst.ledger.imports == {}
    assert puller.pulls == {}
    assert peers.dst.ledger.alloc.free_bytes == REGION - HEADER_BYTES
    assert sample(peers.dst, "dsv4_kv_released_total", kind="import", reason="pulled") == 1
    assert sample(peers.dst, "dsv4_kv_staging_free_bytes") == REGION - HEADER_BYTES
    with pytest.raises(ApiError) as e:
        puller.status(pid)
    assert (e.value.status, e.value.code) == (404, "unknown_pull")


def test_a_failed_data_path_frees_the_extent_and_leaves_the_export_to_its_lease(
    peers: Peers,
) -> None:
    blocking = Blocking(fail_protocol)
    blocking.go.set()
    puller = peers.puller(blocking)
    st = puller.start(PullRequest(peers.export("t2", PAYLOAD), wait_s=5.0))
    assert st == {
        "pull_id": st["pull_id"],
        "state": "failed",
        "bytes_done": 0,
        "total_bytes": NBYTES,
        "remote_transfer_id": "t2",
        "error": f"KV pull from 127.0.0.1:{peers.port} failed: "
        "TransferFailed: the bytes came back wrong",
        "reason": "protocol",
    }
    assert peers.dst.ledger.imports == {}
    assert sample(peers.dst, "dsv4_kv_released_total", kind="import", reason="aborted") == 1
    assert sample(peers.dst, "dsv4_kv_pull_failures_total", reason="protocol") == 1
    assert sample(peers.dst, "dsv4_kv_pulls_total", outcome="failed") == 1
    assert list(peers.src.ledger.exports) == ["t2"]  # a retry may still get it
    # the engine acknowledges the failure: nothing left to free
    assert puller.release(st["pull_id"]) == {"pull_id": st["pull_id"], "freed": False}
    assert puller.pulls == {}


def test_a_pull_of_an_unknown_transfer_fails_without_reserving(peers: Peers) -> None:
    puller = peers.puller()
    params = peers.export("t3", PAYLOAD)
    peers.src.abort_export("t3")
    st = puller.start(PullRequest(params, wait_s=5.0))
    assert (st["state"], st["reason"]) == ("failed", "unknown_transfer")
    assert peers.dst.ledger.imports == {}
    assert sample(peers.dst, "dsv4_kv_released_total", kind="import", reason="aborted") == 0
    assert sample(peers.dst, "dsv4_kv_pull_failures_total", reason="unknown_transfer") == 1


def test_a_pull_given_up_while_running_is_freed_when_its_worker_stops(peers: Peers) -> None:
    tcp = make_transport("tcp", streams=1)
    blocking = Blocking(tcp.fetch)
    puller = peers.puller(blocking)
    st = puller.start(PullRequest(peers.export("t4", PAYLOAD)))
    pid = st["pull_id"]
    assert st["state"] == "pending"
    assert blocking.started.wait(5)
    assert peers.dst.ledger.imports[pid] == Import(pid, HEADER_BYTES, EXTENT, NBYTES)
    # the engine gives up: the extent is being written, so it is freed when the worker stops
    assert puller.release(pid) == {"pull_id": pid, "freed": False}
    assert pid in peers.dst.ledger.imports
    blocking.go.set()
    until("the pull forgotten", lambda: puller.count() == 0)
    assert peers.dst.ledger.imports == {}
    assert peers.dst.ledger.alloc.free_bytes == REGION - HEADER_BYTES
    assert sample(peers.dst, "dsv4_kv_released_total", kind="import", reason="aborted") == 1


def test_pulled_kv_left_past_its_lease_reads_expired(peers: Peers) -> None:
    puller = peers.puller()
    pid = puller.start(PullRequest(peers.export("t5", PAYLOAD), wait_s=5.0))["pull_id"]
    puller.on_expired([pid])
    st = puller.status(pid)
    assert (st["state"], st["reason"]) == ("expired", "expired")
    assert "within the lease" in st["error"]


def test_a_status_long_poll_returns_when_the_pull_ends(peers: Peers) -> None:
    blocking = Blocking(fail_protocol)
    puller = peers.puller(blocking)
    pid = puller.start(PullRequest(peers.export("t6", PAYLOAD)))["pull_id"]
    threading.Timer(0.2, blocking.go.set).start()
    t0 = time.monotonic()
    assert puller.status(pid, wait_s=10.0)["state"] == "failed"
    assert time.monotonic() - t0 < 5.0


class Recording(Transport):
    """The tcp transport, noting which thread fetched and whether the data request had gone
    out with the manifest's."""

    name = "tcp"

    def __init__(self) -> None:
        self.tcp = make_transport("tcp", streams=1)
        self.threads: list[threading.Thread] = []
        self.requested: list[bool] = []

    def pipelined_request(self, conn: PeerConnection, transfer_id: str, total_bytes: int) -> bytes:
        return self.tcp.pipelined_request(conn, transfer_id, total_bytes)

    def fetch(self, job: FetchJob) -> None:
        self.threads.append(threading.current_thread())
        self.requested.append(job.requested)
        self.tcp.fetch(job)


def test_a_small_pull_asked_with_a_wait_runs_on_the_asking_thread_in_one_round_trip(
    peers: Peers,
) -> None:
    rec = Recording()
    puller = peers.puller(rec)
    st = puller.start(PullRequest(peers.export("t7", PAYLOAD), wait_s=5.0))
    assert st["state"] == "done" and rec.threads == [threading.current_thread()]
    assert rec.requested == [True]  # the READ went out with MANIFEST_REQ
    with peers.dst.region.view(st["offset"], NBYTES) as v:
        assert bytes(v) == PAYLOAD
    # the prefill side frees its export after the answer (on a pool thread)
    until("the export released", lambda: "t7" not in peers.src.ledger.exports)
    # without a wait (or past INLINE_PULL_BYTES) the pull goes to the pool
    pid = puller.start(PullRequest(peers.export("t8", PAYLOAD)))["pull_id"]
    assert puller.status(pid, wait_s=5.0)["state"] == "done"
    assert rec.threads[1] is not threading.current_thread()
