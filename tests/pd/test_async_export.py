"""A prefill's KV export on the connector's thread, against real sidecars on 127.0.0.1: the
engine's call returns while the sidecar has not answered yet (stopped with SIGSTOP), the result
arrives once it does and names KV that a decode sidecar pulls bit-exactly (the request's blocks
and slot), and a sidecar that is gone gives the export_failed failure, not a hang."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

from dsv4_common.process import free_port
from dsv4_kvtransfer.buffers import Layout
from dsv4_kvtransfer.client import SidecarClient
from dsv4_kvtransfer.pd_protocol import RemotePrefillParams
from dsv4_serving.engine.kv_connector.compat import KVCompat
from dsv4_serving.engine.kv_connector.exporter import KVExporter, SaveResult
from dsv4_serving.engine.kv_connector.kv_layout import KVLayout
from dsv4_serving.engine.kv_connector.metadata import KVTransferFailure, SaveSpec
from tests.pd.sidecars import SidecarFactory

BLOCK = 4
COMPAT = KVCompat("DeepseekV4ForCausalLM", BLOCK, 0, "float32")


class TinyCache:
    """A model cache as the connector sees it: one paged group, one per-sequence group."""

    block_size = BLOCK

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.comp = torch.randn(16, BLOCK, 8, generator=g)
        self.window = torch.randn(3, 5, 8, generator=g)

    def named_paged_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        return [("layers.0.comp", "comp4", self.comp)]

    def named_state_tensors(self) -> list[tuple[str, str, torch.Tensor]]:
        return [("layers.0.window", "window", self.window)]


def exporter(url: str, cache: TinyCache, done: threading.Event) -> KVExporter:
    layout = KVLayout(cache)
    return KVExporter(SidecarClient(url, timeout_s=5.0), lambda: layout, COMPAT, done.set)


def result(ex: KVExporter, done: threading.Event) -> SaveResult:
    assert done.wait(30), "the export never ended"
    [r] = ex.finished()
    return r


SAVE = SaveSpec("r1", [5, 2, 9, 11], 1, 10, list(range(1, 11)), first_token=7)


def test_an_export_runs_beside_the_engine_and_is_pulled_bit_exact(
    sidecars: SidecarFactory,
) -> None:
    src, dst = sidecars.start(), sidecars.start()
    cache, done = TinyCache(), threading.Event()
    ex = exporter(src.control_url, cache, done)
    try:
        assert src.pid is not None
        os.killpg(src.pid, signal.SIGSTOP)  # the sidecar answers nothing for now
        try:
            t = time.monotonic()
            ex.submit(SAVE)
            assert time.monotonic() - t < 0.5  # the engine's step goes on
            time.sleep(0.3)
            assert ex.finished() == [] and ex.in_flight == 1 and not done.is_set()
        finally:
            os.killpg(src.pid, signal.SIGCONT)
        r = result(ex, done)
    finally:
        ex.close()
    assert ex.in_flight == 0 and r.request_id == "r1"
    assert isinstance(r.outcome, RemotePrefillParams), r.outcome
    n = 3  # blocks of 10 tokens
    planned = Layout.plan(KVLayout(cache).specs(n)).total_bytes  # the buffers, aligned
    assert r.nbytes == r.outcome.remote_total_bytes == planned
    assert r.outcome.remote_num_tokens == 10 and r.outcome.remote_state_slot == 1

    client = SidecarClient(dst.control_url)
    st = client.start_pull(r.outcome, wait_s=10)
    kv = st.kv or client.wait_pull(st.pull_id, 30)
    comp, window = kv.buffers["layers.0.comp"], kv.buffers["layers.0.window"]
    got = torch.frombuffer(client.view(comp), dtype=torch.float32).view(n, BLOCK, 8)
    assert torch.equal(got, cache.comp[[5, 2, 9]])  # the request's first 3 blocks, in order
    got = torch.frombuffer(client.view(window), dtype=torch.float32).view(5, 8)
    assert torch.equal(got, cache.window[1])
    assert kv.remote_meta["engine_meta"]["first_token"] == 7
    client.release_pull(kv.pull_id)
    client.close()


def test_an_export_to_a_sidecar_that_is_gone_fails_as_export_failed() -> None:
    done = threading.Event()
    ex = exporter(f"http://127.0.0.1:{free_port()}", TinyCache(), done)
    try:
        ex.submit(SAVE)
        r = result(ex, done)
    finally:
        ex.close()
    assert isinstance(r.outcome, KVTransferFailure) and r.nbytes == 0
    assert r.outcome.reason == "export_failed" and "unreachable" in r.outcome.message
