"""Two real sidecars on 127.0.0.1 moving KV: bit-exact over each transport, and every way a
transfer can go wrong (wrong token, garbage, oversize frames, a source killed mid-transfer,
leases running out) leaves both staging regions as free as they started."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import struct
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from dsv4_kvtransfer.auth import proof
from dsv4_kvtransfer.buffers import BufferSpec
from dsv4_kvtransfer.client import PullFailed, SidecarClient, SidecarError
from dsv4_kvtransfer.frames import HANDSHAKE_LIMITS, FrameType, encode, read_frame, send_frame
from dsv4_kvtransfer.launch import sidecar_argv
from dsv4_kvtransfer.local_pull import FastConnection
from dsv4_kvtransfer.pd_protocol import RemotePrefillParams
from tests.helpers import wait_for
from tests.pd.sidecars import SidecarFactory, SidecarProc

MB = 1 << 20


def v4_like_specs(bulk_mb: int) -> list[BufferSpec]:
    """One sequence's KV as DeepSeek V4's cache holds it (bf16 rows of 512, indexer keys of 128,
    fp32 compressor state), plus a bulk group of ``bulk_mb`` MB and an empty buffer."""
    return [
        BufferSpec("layers.0.window", "bfloat16", (1, 128, 512), "window"),
        BufferSpec("layers.2.window", "bfloat16", (1, 128, 512), "window"),
        BufferSpec("layers.2.comp", "bfloat16", (33, 32, 512), "comp4"),
        BufferSpec("layers.2.index", "bfloat16", (33, 32, 128), "index"),
        BufferSpec("layers.2.comp_state", "float32", (1, 8, 2048), "comp_state"),
        BufferSpec("layers.2.index_state", "float32", (1, 8, 512), "index_state"),
        BufferSpec("layers.3.comp", "bfloat16", (33, 1, 512), "comp128"),
        BufferSpec("bulk", "uint8", (bulk_mb * MB + 12345,), "bulk"),
        BufferSpec("empty", "float32", (0, 512), "empty"),
    ]


def export(src: SidecarProc, specs: list[BufferSpec], seed: int, request_id: str = "req-1"):
    """Write random KV into ``src``'s staging region as the prefill engine would; -> (params,
    {name: bytes})."""
    rng = np.random.default_rng(seed)
    res = src.client.reserve_export(
        request_id,
        specs,
        block_ids=[7, 8, 9],
        num_tokens=300,
        state_slot=1,
        cache_groups={"comp4": 3, "window": 1},
        engine_meta={"first_token": 42, "seed": seed},
    )
    data = {}
    for spec in specs:
        view = src.client.view(res.buffers[spec.name])
        data[spec.name] = rng.bytes(len(view))
        view[:] = data[spec.name]
        view.release()
    return src.client.commit_export(res.transfer_id), data


def pull_and_check(dst: SidecarProc, params: dict, specs: list[BufferSpec], data: dict) -> None:
    pull_id = dst.client.start_pull(params).pull_id
    kv = dst.client.wait_pull(pull_id, timeout_s=60)
    for spec in specs:
        placed = kv.buffers[spec.name]
        assert placed.spec == spec
        view = dst.client.view(placed)
        assert bytes(view) == data[spec.name], f"{spec.name} differs after the transfer"
        view.release()
    assert kv.remote_meta["engine_meta"]["first_token"] == 42
    assert kv.remote_meta["num_tokens"] == 300
    dst.client.release_pull(pull_id)


@pytest.mark.parametrize(
    ("transport", "extra"),
    [
        ("tcp", ("--streams", "4", "--min-stream-bytes", "4M", "--max-frame-bytes", "1M")),
        ("shm", ()),
        ("gloo", ()),
    ],
)
def test_kv_moves_bit_exact_and_staging_returns_to_initial(
    sidecars: SidecarFactory, transport: str, extra: tuple[str, ...]
) -> None:
    src = sidecars.start()
    dst = sidecars.start(*extra, transport=transport)
    free_src, free_dst = src.free_bytes(), dst.free_bytes()
    specs = v4_like_specs(bulk_mb=24 if transport != "gloo" else 6)
    total = 0
    for seed in (1, 2):  # twice: the second pull reuses the pooled connection (and the group)
        params, data = export(src, specs, seed, f"req-{seed}")
        p = RemotePrefillParams.from_dict(params)
        assert (p.remote_host, p.remote_port) == ("127.0.0.1", src.port)
        assert p.remote_block_ids == (7, 8, 9) and p.remote_state_slot == 1
        assert p.remote_cache_groups == {"comp4": 3, "window": 1}
        assert src.free_bytes() < free_src
        pull_and_check(dst, params, specs, data)
        total += p.remote_total_bytes
        # the prefill side freed its export as soon as the puller released it
        wait_for("the export freed", lambda: src.free_bytes() == free_src, 10, 0.05)
    assert dst.free_bytes() == free_dst
    assert (
        dst.metric("dsv4_kv_transfer_bytes_total", direction="received", transport=transport)
        == total
    )
    assert src.metric("dsv4_kv_released_total", kind="export", reason="pulled") == 2
    assert dst.metric("dsv4_kv_pulls_total", outcome="done") == 2
    assert dst.metric("dsv4_kv_transfer_latency_seconds_count", transport=transport) == 2
    src.stop()
    dst.stop()
    assert src.exit_code() == 0 and dst.exit_code() == 0
    assert not os.path.exists(f"/dev/shm/{src.shm_name}"), "the region outlived its sidecar"


def test_concurrent_pulls_of_many_requests(sidecars: SidecarFactory) -> None:
    src = sidecars.start()
    dst = sidecars.start("--max-concurrent-pulls", "4")
    free_src, free_dst = src.free_bytes(), dst.free_bytes()
    specs = v4_like_specs(bulk_mb=2)
    exported = [export(src, specs, seed, f"req-{seed}") for seed in range(8)]
    pulls = [(dst.client.start_pull(params).pull_id, data) for params, data in exported]
    for pull_id, data in pulls:
        kv = dst.client.wait_pull(pull_id, 60)
        for spec in specs:
            view = dst.client.view(kv.buffers[spec.name])
            assert bytes(view) == data[spec.name]
            view.release()
        dst.client.release_pull(pull_id)
    wait_for("exports freed", lambda: src.free_bytes() == free_src, 10, 0.05)
    assert dst.free_bytes() == free_dst


def test_wrong_token_is_refused_and_the_export_survives(sidecars: SidecarFactory) -> None:
    src = sidecars.start()
    intruder = sidecars.start(token_file=sidecars.token("not-the-shared-secret-at-all-xyz"))
    dst = sidecars.start()
    free_src = src.free_bytes()
    free_intruder = intruder.free_bytes()
    specs = v4_like_specs(bulk_mb=1)
    params, data = export(src, specs, 5)

    # a sidecar with another token: it sees the source cannot prove the token and gives up
    with pytest.raises(PullFailed) as e:
        intruder.client.wait_pull(intruder.client.start_pull(params).pull_id, 30)
    assert e.value.reason == "auth" and "token" in str(e.value)
    assert e.value.pull_id is not None
    intruder.client.release_pull(e.value.pull_id)
    assert intruder.free_bytes() == free_intruder
    assert intruder.metric("dsv4_kv_pull_failures_total", reason="auth") == 1

    # a client that answers the challenge with the wrong token is refused by the source
    with socket.create_connection(("127.0.0.1", src.port), timeout=5) as s:
        send_frame(s, FrameType.HELLO, {"client_nonce": "00" * 32, "client_id": "x"})
        ch = read_frame(s, HANDSHAKE_LIMITS)
        assert ch.type == FrameType.CHALLENGE
        bad = proof(
            b"wrong-token-wrong-token",
            b"client",
            bytes.fromhex(ch.meta["server_nonce"]),
            b"\0" * 32,
        )
        send_frame(s, FrameType.AUTH, {"client_proof": bad.hex()})
        assert read_frame(s, HANDSHAKE_LIMITS).type == FrameType.ERROR
        assert s.recv(1) == b""  # and closed
    wait_for(
        "auth failure counted", lambda: src.metric("dsv4_kv_auth_failures_total") == 1, 5, 0.05
    )

    # the export is untouched: the rightful decode side still gets it
    pull_and_check(dst, params, specs, data)
    wait_for("export freed", lambda: src.free_bytes() == free_src, 10, 0.05)
    assert src.alive()


def _raw_exchange(port: int, payload: bytes) -> bytes:
    """Send raw bytes to the peer port, return what comes back before the sidecar closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
    return out


def test_garbage_and_oversize_frames_are_refused_without_harm(sidecars: SidecarFactory) -> None:
    src = sidecars.start()
    dst = sidecars.start()
    free_src = src.free_bytes()
    specs = v4_like_specs(bulk_mb=1)
    params, data = export(src, specs, 6)
    rng = np.random.default_rng(0)

    _raw_exchange(src.port, rng.bytes(4096))  # random bytes
    _raw_exchange(src.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # the wrong protocol
    # a valid prefix announcing a 16 MiB header, and one announcing a 1 TiB payload
    huge_meta = struct.pack("!4sBBHIQ", b"DSKV", 1, int(FrameType.HELLO), 0, 16 << 20, 0)
    huge_payload = struct.pack("!4sBBHIQ", b"DSKV", 1, int(FrameType.HELLO), 0, 2, 1 << 40)
    reply = _raw_exchange(src.port, huge_meta)
    assert b"meta_too_large" in reply  # refused with a reason, then closed
    _raw_exchange(src.port, huge_payload + b"{}")
    # a data request before authenticating, and a frame of another protocol version
    _raw_exchange(src.port, encode(FrameType.READ, {"transfer_id": "x", "offset": 0, "length": 1}))
    _raw_exchange(src.port, b"DSKV\x09" + bytes(15))
    # a half-sent frame, then silence: the handshake timeout is not waited for here
    with socket.create_connection(("127.0.0.1", src.port), timeout=5) as s:
        s.sendall(b"DSKV\x01")

    def rejected(reason: str) -> float:
        return src.metric("dsv4_kv_frames_rejected_total", reason=reason)

    wait_for("rejections counted", lambda: rejected("unexpected_type") >= 1, 5, 0.05)
    assert rejected("bad_magic") >= 2
    assert rejected("meta_too_large") == 1
    assert rejected("unexpected_payload") == 1
    assert rejected("bad_version") == 1
    assert src.alive()
    # still serving, the export intact
    pull_and_check(dst, params, specs, data)
    wait_for("export freed", lambda: src.free_bytes() == free_src, 10, 0.05)


def test_source_killed_mid_transfer_fails_the_pull_and_frees_the_decode_side(
    sidecars: SidecarFactory,
) -> None:
    # a send-rate cap stretches the transfer to seconds, so the kill lands in the middle
    src = sidecars.start("--send-rate", "8M")
    dst = sidecars.start("--streams", "1")
    free_dst = dst.free_bytes()
    params, _ = export(src, [BufferSpec("bulk", "uint8", (24 * MB,), "bulk")], 7)
    pull_id = dst.client.start_pull(params, timeout_s=60).pull_id
    st = wait_for(
        "bytes arriving",
        lambda: (s := dst.client.poll_pull(pull_id)) and s.bytes_done > 0 and s,
        20,
        0.02,
    )
    assert st.state == "pending" and 0 < st.bytes_done < st.total_bytes == 24 * MB
    assert st.kv is None
    src.kill()
    with pytest.raises(PullFailed) as e:
        dst.client.wait_pull(pull_id, 30)
    assert e.value.reason == "connection"
    assert dst.free_bytes() == free_dst
    assert dst.metric("dsv4_kv_pull_failures_total", reason="connection") == 1
    dst.client.release_pull(pull_id)
    assert dst.alive()

    # a sidecar restarted under the dead one's name replaces its stale region, all free
    again = sidecars.start(shm_name=src.shm_name)
    assert again.free_bytes() == int(again.info()["staging_bytes"])  # type: ignore[call-overload]
    # the engine's client still maps the dead sidecar's region: at its next reservation it
    # must switch to the new one, or the KV it writes would never reach the sidecar
    stale = src.client.region()
    src.client.port = again.control_port  # the same URL, now served by the new sidecar
    again.client = src.client
    params, data = export(again, v4_like_specs(1), 8)
    assert src.client.region() is not stale
    pull_and_check(dst, params, v4_like_specs(1), data)
    assert dst.free_bytes() == free_dst


def test_decode_side_killed_mid_transfer_leaves_the_export_to_its_lease(
    sidecars: SidecarFactory,
) -> None:
    src = sidecars.start("--send-rate", "8M", lease=2.0)
    dst = sidecars.start("--streams", "1")
    free_src = src.free_bytes()
    params, _ = export(src, [BufferSpec("bulk", "uint8", (24 * MB,), "bulk")], 11)
    pull_id = dst.client.start_pull(params, timeout_s=60).pull_id
    wait_for("bytes arriving", lambda: dst.client.poll_pull(pull_id).bytes_done > 0, 20, 0.02)
    dst.kill()
    # the reader's pin goes with its connection; the lease then frees the export
    wait_for("export freed by its lease", lambda: src.free_bytes() == free_src, 15, 0.1)
    assert src.metric("dsv4_kv_lease_expiries_total", kind="export") == 1
    assert src.alive()


def test_a_killed_sidecar_s_region_and_socket_go_with_its_stop(sidecars: SidecarFactory) -> None:
    # a SIGKILLed sidecar cannot unlink its /dev/shm files: whoever started it does (CI runs
    # ran out of /dev/shm on the regions of sidecars killed by earlier runs)
    sc = sidecars.start(staging="8M")
    region = sc.region
    ctl = region.with_name(region.name + ".ctl")
    assert region.exists() and ctl.exists()
    assert sc.pid is not None
    os.killpg(sc.pid, signal.SIGKILL)
    wait_for("the sidecar gone", lambda: not sc.running(), 10, 0.05)
    assert region.exists() and ctl.exists()  # nothing of its own cleaned up
    sc.stop()
    assert not region.exists() and not ctl.exists()


def test_leases_expire_on_both_sides(sidecars: SidecarFactory) -> None:
    src = sidecars.start(lease=1.0)
    dst = sidecars.start(lease=2.0)
    free_src, free_dst = src.free_bytes(), dst.free_bytes()
    specs = v4_like_specs(bulk_mb=1)

    # an export nobody pulls: freed when its lease runs out, and a late pull is refused
    params, _ = export(src, specs, 9)
    assert src.free_bytes() < free_src
    wait_for("export lease expiry", lambda: src.free_bytes() == free_src, 5, 0.05)
    assert src.metric("dsv4_kv_lease_expiries_total", kind="export") == 1
    with pytest.raises(PullFailed) as e:
        dst.client.wait_pull(dst.client.start_pull(params).pull_id, 10)
    assert e.value.reason == "unknown_transfer" and e.value.pull_id is not None
    dst.client.release_pull(e.value.pull_id)
    assert dst.free_bytes() == free_dst

    # pulled KV the engine never takes: freed on the decode side when its lease runs out
    params, _ = export(src, specs, 10)
    pull_id = dst.client.start_pull(params).pull_id
    dst.client.wait_pull(pull_id, 10)
    wait_for("export freed after pull", lambda: src.free_bytes() == free_src, 5, 0.05)
    assert dst.free_bytes() < free_dst
    wait_for("import lease expiry", lambda: dst.free_bytes() == free_dst, 5, 0.05)
    with pytest.raises(PullFailed) as e:
        dst.client.poll_pull(pull_id)
    assert e.value.reason == "expired"
    assert dst.metric("dsv4_kv_lease_expiries_total", kind="import") == 1

    # a reservation the engine never commits (it died mid-write) is freed the same way
    src.client.reserve_export("req-dead", specs)
    wait_for("reservation expiry", lambda: src.free_bytes() == free_src, 5, 0.05)


def test_the_fast_control_socket_serves_the_same_api_and_http_stays(
    sidecars: SidecarFactory,
) -> None:
    """The engine's client prefers the fast socket beside the region (0600, named by /v1/info);
    answers and errors are the HTTP API's; a client that cannot reach it uses HTTP."""
    sc = sidecars.start(staging="16M")
    free = sc.free_bytes()
    info = sc.client.info()
    assert info["fast_socket"] == sc.shm_name + ".ctl"
    path = os.path.join("/dev/shm", info["fast_socket"])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    fast, http = SidecarClient(sc.url), SidecarClient(sc.url, fast=False)
    for c in (fast, http):
        with pytest.raises(SidecarError) as e:
            c.start_pull({"do_remote_prefill": True, "remote_port": "x"})
        assert (e.value.status, e.value.code) == (400, "bad_kv_transfer_params")
        with pytest.raises(SidecarError) as e:
            c.request("GET", "/v1/nothing")
        assert (e.value.status, e.value.code) == (404, "not_found")
        res = c.reserve_export("r", [BufferSpec("x", "uint8", (10,))])
        assert c.abort_export(res.transfer_id) is None
    assert fast._fast_idle and not http._fast_idle  # one went over the socket, one did not
    # a malformed request ends that connection only
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(path)
        raw.sendall(struct.pack("!I", 5) + b"junk\n")
        assert raw.recv(1) == b""
    # the socket out of reach (another shm mount): HTTP
    elsewhere = SidecarClient(sc.url, shm_dir=str(sidecars.tmp))
    assert elsewhere.request("GET", "/v1/info")["shm_name"] == sc.shm_name
    assert not elsewhere._fast_idle and elsewhere._fast_path is None
    assert sc.free_bytes() == free
    for c in (fast, http, elsewhere):
        c.close()
    sc.stop()
    assert sc.exit_code() == 0 and not os.path.exists(path)


def test_control_api_refuses_bad_requests_clearly(sidecars: SidecarFactory) -> None:
    sock = sidecars.tmp / "control.sock"
    sc = sidecars.start(control_socket=str(sock), staging="16M")
    free = sc.free_bytes()
    # the same API on the unix socket
    over_unix = SidecarClient(unix_socket=str(sock))
    assert over_unix.info()["shm_name"] == sc.shm_name
    # the metrics listener serves probes and metrics, and nothing else
    probes = SidecarClient(f"http://127.0.0.1:{sc.metrics_port}")
    assert probes.request("GET", "/health")["status"] == "ok"
    with urllib.request.urlopen(f"http://127.0.0.1:{sc.metrics_port}/metrics") as r:
        assert b"dsv4_kv_staging_free_bytes" in r.read()
    with pytest.raises(SidecarError) as e:
        probes.reserve_export("r", [BufferSpec("x", "uint8", (1,))])
    assert e.value.status == 404
    with pytest.raises(SidecarError) as e:
        sc.client.start_pull({"do_remote_prefill": True, "remote_port": "x"})
    assert e.value.status == 400 and "kv_transfer_params." in str(e.value)
    with pytest.raises(SidecarError) as e:
        sc.client.reserve_export("big", [BufferSpec("x", "uint8", (64 * MB,))])
    assert e.value.status == 507 and e.value.code == "staging_full"
    with pytest.raises(SidecarError) as e:
        sc.client.request("POST", "/v1/exports", {"request_id": "r", "buffers": [{"name": "x"}]})
    assert e.value.status == 400
    with pytest.raises(SidecarError) as e:
        sc.client.poll_pull("nope")
    assert e.value.status == 404
    with pytest.raises(SidecarError) as e:
        sc.client.reserve_export("r", [BufferSpec("x", "uint8", (1,))], block_ids=[0] * 70000)
    assert e.value.status == 400 and "block_ids" in str(e.value)
    res = sc.client.reserve_export("r1", [BufferSpec("x", "float32", (1000,))])
    sc.client.abort_export(res.transfer_id)
    with pytest.raises(SidecarError) as e:
        sc.client.commit_export(res.transfer_id)
    assert e.value.status == 404
    assert sc.free_bytes() == free
    assert sc.client.request("GET", "/health")["status"] == "ok"


def test_control_api_errors_are_the_openai_body_naming_the_field(
    sidecars: SidecarFactory,
) -> None:
    sc = sidecars.start(staging="16M")
    req = urllib.request.Request(
        sc.url + "/v1/exports",
        data=json.dumps({"request_id": "r", "buffers": "x"}).encode(),
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400
    assert json.loads(e.value.read()) == {
        "error": {
            "message": "buffers must be a list of {name, dtype, shape}",
            "type": "invalid_request_error",
            "param": "buffers",
            "code": "bad_request",
        }
    }


def test_a_restarted_sidecar_is_reached_past_every_stale_fast_connection(
    sidecars: SidecarFactory,
) -> None:
    """Several idle fast connections to a sidecar that was killed and replaced on the same
    region name: the next call reaches the new one (it once failed on the second stale one)."""
    old = sidecars.start(staging="16M")
    client = SidecarClient(old.url)
    client.request("GET", "/v1/info")  # learns the socket, keeps one connection
    assert client._fast_path
    # two more idle connections, as concurrent calls leave them
    client._fast_idle += [FastConnection(client._fast_path, 5.0) for _ in range(2)]
    assert len(client._fast_idle) == 3
    old.kill()
    new = sidecars.start(
        "--control-port", str(old.control_port), staging="16M", shm_name=old.shm_name
    )
    assert client.request("GET", "/v1/info")["shm_name"] == old.shm_name
    assert client._fast_path and len(client._fast_idle) == 1  # the new socket, one connection
    client.close()
    new.stop()
    assert new.exit_code() == 0


@pytest.mark.parametrize(("transport", "needs"), [("hccl", "torch_npu"), ("rdma", "mooncake")])
def test_unavailable_transports_fail_fast_with_a_clear_message(
    sidecars: SidecarFactory, transport: str, needs: str
) -> None:
    argv = sidecar_argv(sidecars.token_file, transport=transport, port=0)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert needs in proc.stderr and "--transport tcp" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_no_token_is_refused_at_start() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DSV4_KV_AUTH_TOKEN_FILE"}
    argv = sidecar_argv(None, port=0)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "--auth-token-file is required" in proc.stderr


def test_short_token_is_refused_at_start(sidecars: SidecarFactory) -> None:
    argv = sidecar_argv(sidecars.token("short"), port=0)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "at least 16 are required" in proc.stderr


def test_a_setting_out_of_range_is_refused_at_start_naming_it(sidecars: SidecarFactory) -> None:
    argv = sidecar_argv(sidecars.token_file, port=0, lease_seconds=0)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "lease_seconds must be in (0, 3600], not 0.0" in proc.stderr


def _sigterm(sc: SidecarProc) -> None:
    assert sc.pid is not None
    os.kill(sc.pid, signal.SIGTERM)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_sigterm_waits_until_held_exports_are_pulled(sidecars: SidecarFactory) -> None:
    src = sidecars.start("--shutdown-timeout", "60")
    dst = sidecars.start()
    specs = v4_like_specs(bulk_mb=1)
    params, data = export(src, specs, 3)
    _sigterm(src)
    wait_for("/ready 503", lambda: _status(src.url + "/ready") == 503, 5, 0.05)
    metrics_url = f"http://127.0.0.1:{src.metrics_port}"
    assert _status(metrics_url + "/ready") == 503 and _status(src.url + "/health") == 200
    with pytest.raises(SidecarError) as e:  # no new exports ...
        src.client.reserve_export("req-new", specs)
    assert e.value.status == 503 and e.value.code == "draining"
    time.sleep(0.5)
    assert src.alive()  # ... but it stays for the one it holds
    pull_and_check(dst, params, specs, data)
    wait_for("exit after the pull", lambda: not src.alive(), 10, 0.05)
    assert src.exit_code() == 0


def test_sigterm_waits_at_most_for_the_lease(sidecars: SidecarFactory) -> None:
    src = sidecars.start("--shutdown-timeout", "60", lease=2.0)
    export(src, v4_like_specs(bulk_mb=1), 4)
    t = time.monotonic()
    _sigterm(src)
    wait_for("exit after the lease", lambda: not src.alive(), 10, 0.05)
    assert src.exit_code() == 0 and 1.0 < time.monotonic() - t < 6.0
    # and with nothing held, it goes at once
    idle = sidecars.start("--shutdown-timeout", "60")
    t = time.monotonic()
    _sigterm(idle)
    wait_for("exit", lambda: not idle.alive(), 5, 0.05)
    assert idle.exit_code() == 0 and time.monotonic() - t < 2.0


def test_a_small_pull_slower_than_the_clients_call_timeout_still_lands(
    sidecars: SidecarFactory,
) -> None:
    """A pull small enough to run during its start request (the inline path) answers when it
    is done: the engine's client must wait for the pull's own deadline, not give up after its
    per-call timeout (then it never learns the pull id and the pulled KV stays held)."""
    src = sidecars.start("--send-rate", "1M")  # 3 MiB: about 3 s, over the 1 s call timeout
    dst = sidecars.start("--streams", "1")
    free_dst = dst.free_bytes()
    specs = [BufferSpec("bulk", "uint8", (3 * MB,), "bulk")]
    params, data = export(src, specs, 13)
    impatient = SidecarClient(f"http://127.0.0.1:{dst.control_port}", timeout_s=1.0)
    t0 = time.monotonic()
    st = impatient.start_pull(params, timeout_s=30, wait_s=0.5)
    while st.kv is None:
        st = impatient.poll_pull(st.pull_id, wait_s=0.5)
    assert time.monotonic() - t0 > 1.5  # the cap made it slower than the call timeout
    view = dst.client.view(st.kv.buffers["bulk"])
    assert bytes(view) == data["bulk"]
    view.release()
    impatient.release_pull(st.pull_id)
    assert dst.free_bytes() == free_dst
