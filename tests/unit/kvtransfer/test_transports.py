from __future__ import annotations

import argparse

import pytest

from dsv4_kvtransfer.config import parse_size
from dsv4_kvtransfer.peer_server import RateLimiter
from dsv4_kvtransfer.transports import TransportUnavailable, make_transport
from dsv4_kvtransfer.transports.tcp import split_ranges

MB = 1 << 20


def test_split_ranges_cover_the_extent_in_aligned_streams() -> None:
    assert split_ranges(0, 4, MB) == []
    assert split_ranges(10, 4, MB) == [(0, 10)]  # small: one stream
    assert split_ranges(3 * MB, 4, MB) == [(0, MB), (MB, MB), (2 * MB, MB)]
    r = split_ranges(100 * MB + 5, 4, 32 * MB)
    # ceil((100 MiB + 5) / 3) = 34952536, rounded up to 4096 -> 34955264
    assert r == [(0, 34955264), (34955264, 34955264), (69910528, 34947077)]
    assert sum(n for _, n in r) == 100 * MB + 5 and all(o % 4096 == 0 for o, _ in r)
    r = split_ranges(1000 * MB, 4, 32 * MB)
    assert len(r) == 4 and r[-1][0] + r[-1][1] == 1000 * MB


def test_hccl_and_rdma_fail_fast_without_their_libraries() -> None:
    pytest.importorskip("torch")
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        with pytest.raises(TransportUnavailable, match="torch_npu"):
            make_transport("hccl")
    try:
        import mooncake.engine  # noqa: F401
    except Exception:
        with pytest.raises(TransportUnavailable, match="mooncake"):
            make_transport("rdma")
    with pytest.raises(TransportUnavailable, match="unknown transport"):
        make_transport("pigeon")
    assert make_transport("tcp").name == "tcp"


def test_sizes_on_the_command_line() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("64M") == 64 * MB
    assert parse_size("1G") == 1 << 30
    assert parse_size("512MiB") == 512 * MB
    assert parse_size("1.5K") == 1536
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")


def test_rate_limiter_spaces_sends_exactly() -> None:
    now = [10.0]
    slept: list[float] = []
    r = RateLimiter(100.0, clock=lambda: now[0], sleep=slept.append)  # 100 bytes/s
    r.acquire(50)  # the first send goes at once, and books 0.5 s
    r.acquire(100)  # waits for the first one's 0.5 s
    assert slept == [0.5]
    now[0] = 12.0  # idle past both bookings: no debt carried over
    r.acquire(10)
    r.acquire(10)
    assert slept == pytest.approx([0.5, 0.1])
    RateLimiter(0, sleep=slept.append).acquire(1 << 40)  # 0 = unlimited
    assert slept == pytest.approx([0.5, 0.1])
