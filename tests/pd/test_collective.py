"""The collective (hccl) data path without NPUs: the same two-rank group, chunking and bounce
buffer over gloo on CPU."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dsv4_kvtransfer.transports.collective import Channel, make_group

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("staged", [False, True])
def test_bytes_cross_a_two_rank_group_in_chunks(staged: bool) -> None:
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    n = 10_000 + 123  # not a multiple of the chunk
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dst = bytearray(n)
    channels: dict[int, Channel] = {}

    def join(rank: int) -> None:
        s = store if rank else torch.distributed.TCPStore("127.0.0.1", store.port, is_master=False)
        group = make_group("gloo", torch.distributed.PrefixStore(f"t{staged}/", s), rank, 30)
        channels[rank] = Channel("gloo", group, s, "cpu", staged=staged, chunk=1000)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    landed: list[int] = []
    sender = threading.Thread(target=channels[0].send, args=(memoryview(src.data), 1))
    sender.start()
    channels[1].recv(memoryview(dst), 0, landed.append)
    sender.join()
    assert bytes(dst) == src.tobytes()
    assert landed == [1000] * 10 + [123]
    if staged:  # one bounce buffer of one chunk, reused
        assert channels[1].bounce.numel() == 1000
    for ch in channels.values():
        ch.close()
