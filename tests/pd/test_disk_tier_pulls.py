"""Prefix pulls served from a sidecar's disk tier, a real engine and sidecar on 127.0.0.1
(dsv4-tiny, block size 16): engine ``a``'s sidecar keeps a host tier of one offered prefix and
a disk tier under it, so the next session's offer spills the previous one to disk. A turn 2
whose prefix is on disk (and no longer in ``a``'s device cache) is pulled back and its greedy
tokens equal a plain engine's (``ref``); a prefix whose file was corrupted on disk is computed
instead (counted by the engine and the sidecar), its tokens just as exact."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from dsv4_kvtransfer.pd_protocol import PREFIX_PULL, PrefixPullParams
from tests.helpers import wait_for
from tests.pd.engines import EngineProc, start_engine
from tests.pd.sidecars import SidecarFactory, SidecarProc
from tests.pd.test_prefix_pull import SYNC, TINY, body, complete, offered, prompt, pulled, tokens

# one offered 208-token prefix of dsv4-tiny (472 KiB) fits, two do not: each offer spills the
# one before
HOST_TIER = ("--kv-host-bytes", "600K")


@dataclass
class Stack:
    ref: EngineProc
    a: EngineProc
    sa: SidecarProc
    disk: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("disk-tier-pulls")
    f = SidecarFactory(tmp, f"d{int(time.time() * 1000) % 10**8}")
    engines: list[EngineProc] = []
    disk = tmp / "kv-disk"
    try:
        sa = f.start(*HOST_TIER, "--kv-disk-bytes", "64M", "--kv-disk-dir", str(disk))
        engines.append(start_engine("ref", tmp, *TINY))
        # 48 blocks: three 400-token prompts evict a finished session's blocks
        a_args = ("--role", "both", "--kv-sidecar", sa.control_url, "--num-kv-blocks", "48")
        engines.append(start_engine("a", tmp, *TINY, *SYNC, *a_args))
        for e in engines:
            e.wait_ready(600)  # a cold kernel build on a busy host
        yield Stack(engines[0], engines[1], sa, disk)
    except BaseException:
        for e in engines:
            print(f"--- engine {e.name} ---\n{e.tail()}")
        print(f.failure_report())
        raise
    finally:
        for e in engines:
            e.stop()
        f.close()


def session(s: Stack, seed: int) -> tuple[list[int], PrefixPullParams]:
    """Turn 1 of a session on ``a``: its tokens so far and the prefix ``a`` offered."""
    p1 = prompt(seed, 200)
    seq = [*p1, *tokens(complete(s.a, body(p1, 24)))]
    return seq, offered(s.sa, seq)


def on_disk(s: Stack, pull: PrefixPullParams) -> Path:
    """The file of ``pull``'s entry, once the next offer spilled it and it was written."""

    def find() -> Path | None:
        names = [n for n in os.listdir(s.disk) if n.startswith(pull.transfer_id)]
        return s.disk / names[0] if names and names[0].endswith(".kv") else None

    wait_for(f"{pull.transfer_id} on disk", lambda: find() is not None, 20, 0.05)
    path = find()
    assert path is not None
    return path


def evict_device_cache(s: Stack) -> None:
    for i in range(3):  # fill a's 48 blocks three times over
        complete(s.a, body(prompt(40 + i, 400), 1))


def test_a_prefix_spilled_to_disk_is_pulled_back_and_decodes_exact(stack: Stack) -> None:
    seq, pull = session(stack, 21)
    session(stack, 22)  # its offer spills the first one
    on_disk(stack, pull)
    evict_device_cache(stack)
    hits = stack.sa.metric("dsv4_kv_disk_tier_hits_total")
    turn2 = [*seq, *prompt(23, 30)]
    want = tokens(complete(stack.ref, body(turn2, 16)))
    before = pulled(stack.a)
    got = complete(stack.a, body(turn2, 16, kv_transfer_params={PREFIX_PULL: pull.to_dict()}))
    assert tokens(got) == want
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 208
    wait_for("a pulls from disk", lambda: pulled(stack.a) == before + 208, 10, 0.1)
    assert stack.sa.metric("dsv4_kv_disk_tier_hits_total") == hits + 1


def test_a_corrupted_file_is_computed_instead_and_counted(stack: Stack) -> None:
    seq, pull = session(stack, 31)
    session(stack, 32)
    path = on_disk(stack, pull)
    with open(path, "r+b") as f:
        f.seek(-64, os.SEEK_END)
        f.write(b"\x5a" * 16)
    evict_device_cache(stack)
    recomputed = stack.a.metric("dsv4_kv_prefix_tokens_total", outcome="recomputed")
    turn2 = [*seq, *prompt(33, 30)]
    want = tokens(complete(stack.ref, body(turn2, 16)))
    got = complete(stack.a, body(turn2, 16, kv_transfer_params={PREFIX_PULL: pull.to_dict()}))
    assert tokens(got) == want
    wait_for(
        "a computes the prefix",
        lambda: stack.a.metric("dsv4_kv_prefix_tokens_total", outcome="recomputed") > recomputed,
        10,
        0.1,
    )
    assert stack.sa.metric("dsv4_kv_disk_tier_drops_total", reason="checksum_mismatch") == 1
    gone = httpx.get(f"{stack.sa.control_url}/v1/host-tier/evictions?since=0").json()
    assert pull.transfer_id in gone["transfer_ids"]
