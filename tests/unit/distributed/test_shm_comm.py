"""The shared-memory collectives' protocol, with members as threads over one real segment:
exact sums and gathers (in slot-sized rounds too), uneven byte exchanges, and a dead or missing
peer named instead of a hang."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dsv4_serving.distributed.shm_comm import ShmChannel, ShmCommError

pytestmark = pytest.mark.unit

SLOT = 256  # bytes: anything above 64 floats goes in several rounds


def _channels(tmp_path: Path, n: int, timeout_s: float = 10.0) -> list[ShmChannel]:
    path = ShmChannel.create_file(n, str(tmp_path), slot_bytes=SLOT)
    chans = [
        ShmChannel.attach(path, tuple(range(10, 10 + n)), i, timeout_s, slot_bytes=SLOT)
        for i in range(n)
    ]
    path.unlink()
    return chans


def _run(chans: list[ShmChannel], fn: Callable[[int, ShmChannel], Any]) -> list[Any]:
    out: list[Any] = [None] * len(chans)

    def body(i: int) -> None:
        try:
            out[i] = fn(i, chans[i])
        except BaseException as e:  # reported to the test
            out[i] = e

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(chans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c in chans:
        c.close()
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_all_reduce_sums_in_member_order_in_rounds(tmp_path: Path, n: int) -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(5, 30, generator=g) for _ in range(n)]  # 600 bytes: 3 rounds
    want = xs[0] + xs[1]
    for x in xs[2:]:
        want = want + x

    def fn(i: int, c: ShmChannel) -> tuple[torch.Tensor, torch.Tensor]:
        y = xs[i].clone()
        assert c.all_reduce(y) is y
        return c.all_reduce(torch.ones(3, dtype=torch.int64) * (i + 1)), y

    got = _run(_channels(tmp_path, n), fn)
    for small, y in got:
        assert torch.equal(y, want)
        assert small.tolist() == [sum(range(1, n + 1))] * 3


def test_all_reduce_of_a_strided_tensor_writes_back(tmp_path: Path) -> None:
    def fn(i: int, c: ShmChannel) -> list[list[float]]:
        x = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).t()  # not contiguous
        c.all_reduce(x)
        return x.tolist()

    assert _run(_channels(tmp_path, 2), fn) == [[[2.0, 6.0], [4.0, 8.0]]] * 2


def test_all_gather_concatenates_in_member_order_along_dim(tmp_path: Path) -> None:
    def fn(i: int, c: ShmChannel) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.arange(6.0).view(2, 3) + 10 * i
        big = torch.full((40, 2), float(i))  # 320 bytes: 2 rounds
        return c.all_gather(x, dim=-1), c.all_gather(big, dim=0)

    got = _run(_channels(tmp_path, 2), fn)
    for cat, big in got:
        assert cat.tolist() == [
            [0.0, 1.0, 2.0, 10.0, 11.0, 12.0],
            [3.0, 4.0, 5.0, 13.0, 14.0, 15.0],
        ]
        assert big[:40].eq(0).all() and big[40:].eq(1).all() and big.shape == (80, 2)


def test_exchange_carries_uneven_and_empty_messages(tmp_path: Path) -> None:
    msgs = [b"x" * 1000, b"", b"abc"]  # 1000 bytes: 4 rounds of 248

    def fn(i: int, c: ShmChannel) -> list[list[bytes]]:
        return [c.exchange(msgs[i]), c.exchange(bytes([i]))]

    for first, second in _run(_channels(tmp_path, 3), fn):
        assert first == msgs
        assert second == [b"\x00", b"\x01", b"\x02"]


def test_a_dead_peer_is_named(tmp_path: Path) -> None:
    a, b = _channels(tmp_path, 2)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    b._flags[1 * 8 + 1] = dead.pid  # member 1's pid line: a process that has exited
    with pytest.raises(
        ShmCommError, match=rf"rank 11 \(pid {dead.pid}\) exited during a collective"
    ):
        a.all_reduce(torch.ones(2))
    a.close()
    b.close()


def test_a_peer_that_never_arrives_times_out_with_its_rank(tmp_path: Path) -> None:
    a, b = _channels(tmp_path, 2, timeout_s=0.6)
    with pytest.raises(ShmCommError, match=r"timed out after \d+ s: rank 11 of group \[10, 11\]"):
        a.exchange(b"hi")
    a.close()
    b.close()


def test_broadcast_copies_the_source_members_tensor_in_rounds(tmp_path: Path) -> None:
    src = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))  # 600 bytes: 3 rounds

    def fn(i: int, c: ShmChannel) -> torch.Tensor:
        x = src.clone() if i == 1 else torch.zeros(3, 50)
        assert c.broadcast(x, 1) is x
        return x

    for got in _run(_channels(tmp_path, 3), fn):
        assert torch.equal(got, src)
