"""A drained stream whose KV cannot be pulled still completes exactly: the decode sidecars keep
what they hold for a millisecond only, so no pull into them succeeds (a moved sequence's export
has expired when the peer asks for it; a PD pull's import too), and the peer recomputes
(``--kv-failure-policy recompute``: prompt + received tokens in one prefill). The client's
stream equals the uninterrupted one. Real engines (dsv4-tiny, MTP on), KV sidecars and a
gateway on 127.0.0.1."""

from __future__ import annotations

import threading
import time

import httpx

from dsv4_common.process import Service
from dsv4_serving.commands.launch import TINY_ENGINE, engine_with_sidecar
from tests.gateway.conftest import _PD_PORTS, LOG_DIR, gateway, pd_pair, running
from tests.gateway.test_drain_migration import _busiest, _stream

STREAMS = 4


def _pulled(e: Service) -> float:
    return e.metric("dsv4_kv_engine_transfers_total", direction="pull", outcome="ok")


def test_a_drained_stream_whose_kv_expired_is_recomputed_exactly() -> None:
    token = LOG_DIR / "drain-fallback-token"
    token.parent.mkdir(parents=True, exist_ok=True)
    token.write_text("drain-fallback-test-token")
    ps, pe = pd_pair("fb-p", "prefill", token)
    decodes = [
        engine_with_sidecar(
            f"fb-d{i}",
            "decode",
            TINY_ENGINE,
            log_dir=LOG_DIR,
            token_file=token,
            taken=_PD_PORTS,
            shm_prefix="dsv4-test",
            lease_seconds=0.001,  # the moved KV expires before anyone pulls it
        )
        for i in range(2)
    ]
    (d0s, d0), (d1s, d1) = decodes
    gw = gateway("gateway-fb", "--prefill", pe.url, "--decode", d0.url, "--decode", d1.url)
    with running(ps, pe, d0s, d0, d1s, d1, timeout_s=900), running(gw) as (g,):
        want = [_stream(g.url, i) for i in range(STREAMS)]
        recomputes = {d.url: d.metric("dsv4_kv_recomputes_total") for d in (d0, d1)}
        pulled = {d.url: _pulled(d) for d in (d0, d1)}
        reached = threading.Semaphore(0)
        got: list[list[int]] = [[] for _ in range(STREAMS)]

        def run(i: int) -> None:
            got[i] = _stream(g.url, i, lambda k: k == 12 and reached.release())

        threads = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        for _ in range(STREAMS):
            assert reached.acquire(timeout=600)
        victim = _busiest(g, (d0, d1))
        moving = httpx.post(f"{victim.url}/drain", json={}, timeout=10).json()["migrating"]
        for t in threads:
            t.join(600)
        assert got == want
        assert moving >= 1
        peer = d1 if victim is d0 else d0
        time.sleep(1)  # the stats reach the front end with the next step's
        assert peer.metric("dsv4_kv_recomputes_total") - recomputes[peer.url] >= moving
        assert _pulled(peer) == pulled[peer.url]  # nothing was imported: all recomputed
        assert g.metric("dsv4_gateway_stream_migrations_total", outcome="failed") == 0
