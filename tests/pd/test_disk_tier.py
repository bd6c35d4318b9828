"""The disk tier of real sidecars on 127.0.0.1: host-tier entries the LRU evicts spill to files,
a pull (by a peer, or by the sidecar's own engine: the serve-back) reads one back into the host
tier and gets its bytes exact, with the writer's layout fingerprint and checksums; a file
corrupted on disk is never served (the pull fails, to be computed instead), is dropped and
counted, and is announced gone like a host-tier eviction. Bad settings stop the sidecar at start
with an error naming the flag."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dsv4_kvtransfer.buffers import BufferSpec
from dsv4_kvtransfer.client import PullFailed
from dsv4_kvtransfer.integrity import Fingerprint
from dsv4_kvtransfer.launch import sidecar_argv
from dsv4_kvtransfer.pd_protocol import prefix_transfer_id
from tests.helpers import wait_for
from tests.pd.sidecars import SidecarFactory, SidecarProc

MB = 1 << 20
SPECS = [
    BufferSpec("layers.0.window", "bfloat16", (1, 128, 512), "window"),
    BufferSpec("layers.2.comp", "bfloat16", (4, 32, 512), "comp4"),
    BufferSpec("layers.2.comp_state", "float32", (1, 8, 2048), "comp_state"),
]
FP = Fingerprint("dsv4-tiny", "bfloat16", 16, {"window": "w1", "comp4": "c1"})


def offer(sc: SidecarProc, k: int) -> tuple[str, dict, dict[str, bytes]]:
    """A prefix offered to ``sc``'s host tier with random KV; -> (transfer id, the params a
    pull names it by, {buffer: bytes})."""
    rng = np.random.default_rng(k)
    key = f"{k:02x}" + "cd" * 31
    res = sc.client.reserve_export(
        f"r{k}", SPECS, num_tokens=64, state_slot=0, fingerprint=FP, prefix_key=key
    )
    data = {}
    for spec in SPECS:
        view = sc.client.view(res.buffers[spec.name])
        data[spec.name] = rng.bytes(len(view))
        view[:] = data[spec.name]
        view.release()
    params = sc.client.commit_export(res.transfer_id)
    assert res.transfer_id == prefix_transfer_id(key)
    return res.transfer_id, params, data


def pull(dst: SidecarProc, params: dict) -> dict[str, bytes]:
    pull_id = dst.client.start_pull(params, fingerprint=FP).pull_id
    kv = dst.client.wait_pull(pull_id, timeout_s=60)
    out = {}
    for spec in SPECS:
        view = dst.client.view(kv.buffers[spec.name])
        out[spec.name] = bytes(view)
        view.release()
    dst.client.release_pull(pull_id)
    return out


def disk_files(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(".kv"))


@pytest.fixture
def tiered(sidecars: SidecarFactory, tmp_path: Path) -> tuple[SidecarProc, SidecarProc, Path]:
    d = tmp_path / "kv-disk"
    # one entry is ~0.3 MiB: the host tier holds two, the disk tier many
    src = sidecars.start(
        "--kv-host-bytes", "700K", "--kv-disk-bytes", "8M", "--kv-disk-dir", str(d)
    )
    return src, sidecars.start(), d


def test_an_entry_spilled_to_disk_is_served_back_exact(
    tiered: tuple[SidecarProc, SidecarProc, Path],
) -> None:
    src, dst, d = tiered
    entries = [offer(src, k) for k in range(3)]  # the third spills the first
    wait_for("the spill written", lambda: len(disk_files(d)) == 1, 10, 0.05)
    info = src.info()
    assert (info["host_tier_entries"], info["disk_tier_entries"]) == (2, 1)
    assert info["disk_bytes"] == 8 * MB and int(str(info["disk_tier_bytes"])) > 0
    tid, params, data = entries[0]
    # on disk, not gone: the engine announces it moved (medium "DISK")
    assert src.client.host_tier_moves(0) == (1, [(tid, "DISK")], False)
    assert src.client.host_evictions(0) == (1, [], False)
    assert disk_files(d)[0].startswith(tid)
    assert pull(dst, params) == data  # a peer's pull: read back, exact
    # it is in the host tier again (the second spilled for its room), its file gone
    info = src.info()
    assert (info["host_tier_entries"], info["disk_tier_entries"]) == (2, 1)
    wait_for(
        "one file",
        lambda: len(disk_files(d)) == 1 and not disk_files(d)[0].startswith(tid),
        10,
        0.05,
    )
    assert src.client.host_tier_moves(1) == (3, [(entries[1][0], "DISK"), (tid, "CPU")], False)
    # the serve-back: the offering engine's own sidecar pulls the entry the disk tier holds
    assert pull(src, entries[1][1]) == entries[1][2]
    assert src.metric("dsv4_kv_disk_tier_spills_total") == 3
    assert src.metric("dsv4_kv_disk_tier_hits_total") == 2
    assert src.metric("dsv4_kv_released_total", kind="export", reason="spilled") == 3
    assert dst.metric("dsv4_kv_pulls_total", outcome="done") == 1


def test_a_corrupted_file_is_never_served_and_is_dropped_counted_and_announced(
    tiered: tuple[SidecarProc, SidecarProc, Path],
) -> None:
    src, dst, d = tiered
    entries = [offer(src, k) for k in range(3)]
    wait_for("the spill written", lambda: len(disk_files(d)) == 1, 10, 0.05)
    path = d / disk_files(d)[0]
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)  # inside the last buffer (the state)
        f.write(b"\xff" * 8)
    tid, params, _ = entries[0]
    with pytest.raises(PullFailed) as e:
        pull(dst, params)
    assert e.value.reason == "unknown_transfer"  # the engine computes the prefix instead
    assert src.metric("dsv4_kv_disk_tier_drops_total", reason="checksum_mismatch") == 1
    assert src.metric("dsv4_kv_disk_tier_hits_total") == 0
    assert src.client.host_tier_moves(0) == (2, [(tid, "DISK"), (tid, None)], False)
    assert disk_files(d) == [] and src.info()["disk_tier_entries"] == 0
    assert pull(dst, entries[2][1]) == entries[2][2]  # the rest serve on


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--kv-host-bytes", "1M", "--kv-disk-bytes", "1000", "--kv-disk-dir", "{tmp}/d"),
            "--kv-disk-bytes must be 0 (off) or at least 1M, not 1000",
        ),
        (("--kv-disk-bytes=-1G",), "argument --kv-disk-bytes: not a size: '-1G'"),
        (
            ("--kv-host-bytes", "1M", "--kv-disk-bytes", "4M", "--kv-disk-dir", "{tmp}/f/d"),
            "--kv-disk-dir {tmp}/f/d: not a writable directory",
        ),
    ],
)
def test_bad_disk_tier_settings_stop_the_sidecar_naming_the_flag(
    sidecars: SidecarFactory, tmp_path: Path, flags: tuple[str, ...], message: str
) -> None:
    (tmp_path / "f").write_text("a file, not a directory")
    argv = sidecar_argv(sidecars.token_file, port=0) + [f.format(tmp=tmp_path) for f in flags]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert message.format(tmp=tmp_path) in proc.stderr


def test_a_same_host_pull_of_a_spilled_entry_is_exact(
    sidecars: SidecarFactory, tiered: tuple[SidecarProc, SidecarProc, Path]
) -> None:
    """The params name where the entry was in the region when offered (``remote_shm``); once
    spilled its trailer there is gone, so the in-place copy declines and the pull asks the
    sidecar, which reads the entry back."""
    src, _, d = tiered
    dst = sidecars.start(transport="shm")
    entries = [offer(src, k) for k in range(3)]
    wait_for("the spill written", lambda: len(disk_files(d)) == 1, 10, 0.05)
    _, params, data = entries[0]
    assert "remote_shm" in params
    assert pull(dst, params) == data
    assert src.metric("dsv4_kv_disk_tier_hits_total") == 1
    assert dst.metric("dsv4_kv_pulls_total", outcome="done") == 1
