"""KV-transfer bandwidth of the sidecars beside a raw loopback baseline, and what it means for
DeepSeek V4's KV.

    .venv/bin/python benchmarks/kv_transfer.py [--sizes 2M 4M 8M 16M 64M 256M 1G] [--reps 3]
        [--transports tcp shm] [--streams 4]

For each size, two real ``dsv4 kv-sidecar`` processes move one export of that many bytes (the
decode side pulls through the client the engine uses, ``SidecarClient.start_pull`` with a wait,
as the engine's connector calls it; timed from that call to the pull done, so the control API,
the manifest and the bookkeeping are inside; the params are parsed before, as the engine parses
them when the request arrives). Over shm on one host that client copies the export itself
into an extent its sidecar granted it and tells the sidecar after (``local_pull``): the first
pull of each size goes through the sidecar and asks for the grant the next ones use, as in an
engine. RELEASE to the prefill side and the adoption's answer come after the pull, untimed,
as in an engine (the next pull or the release reads that answer). The
same bytes are moved between the same two staging regions by the plainest means in the same
run: one TCP socket over 127.0.0.1 (``sendall`` / ``recv_into``) for the TCP transport, one
``memcpy`` for shared memory. GB/s are 1e9 bytes per second; "ratio" is transport / baseline
(goal >= 70%). Best of ``--reps`` (of at least ``SMALL_REPS`` below 64 MiB: those runs take a
few milliseconds, where one scheduler hiccup of a busy host is the whole difference).

Then the KV bytes of DeepSeek V4 (``dsv4-tiny``, and V4 Flash from its published config: the ``deepseek-v4-flash`` shape in
``presets/configs.py``) computed by the model layer's own cache sizing, and the transfer time a
4K-token prompt implies at the bandwidths just measured.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from dsv4_common.process import free_ports
from dsv4_kvtransfer.buffers import BufferSpec
from dsv4_kvtransfer.client import SidecarClient, SidecarError
from dsv4_kvtransfer.config import parse_size
from dsv4_kvtransfer.control_requests import MAX_GRANT_BYTES
from dsv4_kvtransfer.launch import SidecarService
from dsv4_kvtransfer.pd_protocol import RemotePrefillParams
from dsv4_serving.presets.configs import preset_config, shape_config

GB = 1e9
SMALL_REPS = 15


class Pair:
    """A source and a destination sidecar process with a given pulling transport."""

    def __init__(self, tmp: Path, transport: str, staging: int, streams: int) -> None:
        self.tmp = tmp
        self.procs: list[SidecarService] = []
        self.ports: set[int] = set()
        self.src = self._start("src", "tcp", staging, streams)
        self.dst = self._start("dst", transport, staging, streams)

    def _start(self, name: str, transport: str, staging: int, streams: int) -> SidecarClient:
        proc = SidecarService(
            f"{name}-{transport}",
            self.tmp / f"{name}-{transport}.log",
            self.tmp / "token",
            free_ports(3, self.ports),
            transport=transport,
            staging_bytes=staging,
            shm_name=f"dsv4-kv-bench-{os.getpid()}-{name}",
            streams=streams,
            log_level="warning",
        )
        self.procs.append(proc)
        proc.start()
        proc.wait_ready(60)
        return SidecarClient(proc.url, timeout_s=120)

    def close(self) -> None:
        self.src.close()
        self.dst.close()
        for p in self.procs:
            p.stop(timeout_s=30)


def fill(view: memoryview) -> None:
    """Deterministic non-trivial bytes (written in 64 MiB pieces to bound temporary memory)."""
    pattern = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    arr = np.frombuffer(view, dtype=np.uint8)
    for pos in range(0, len(arr), len(pattern)):
        n = min(len(pattern), len(arr) - pos)
        arr[pos : pos + n] = pattern[:n]


def pull_once(pair: Pair, size: int, state: dict[str, Any], verify: bool) -> tuple[float, int, int]:
    """Export ``size`` bytes on the source, pull them to the destination; -> (seconds, source
    offset, destination offset)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            res = pair.src.reserve_export("bench", [BufferSpec("kv", "uint8", (size,))])
            break
        except SidecarError as e:
            # the previous pull's export goes when its RELEASE arrives, sent after that pull's
            # answer: at the largest size two do not fit in the region, so wait for it (untimed)
            if e.code != "staging_full" or time.monotonic() > deadline:
                raise
            time.sleep(0.001)
    placed = res.buffers["kv"]
    if state.get("filled") != (placed.offset, size):
        view = pair.src.view(placed)
        fill(view)
        view.release()
        state["filled"] = (placed.offset, size)
    # typed first: the engine's connector pulls with the params its API edge parsed
    params = RemotePrefillParams.from_dict(pair.src.commit_export(res.transfer_id))
    t0 = time.perf_counter()
    st = pair.dst.start_pull(params, timeout_s=300, wait_s=10)
    kv = st.kv or pair.dst.wait_pull(st.pull_id, 300)
    dt = time.perf_counter() - t0
    got = kv.buffers["kv"]
    if verify:
        a, b = pair.src.view(placed), pair.dst.view(got)
        if not np.array_equal(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)):
            raise SystemExit(f"transfer of {size} bytes is not bit-exact")
        a.release()
        b.release()
    pair.dst.release_pull(kv.pull_id)
    # an engine's loop does not wait for the sidecar to answer a release of a pull its client
    # copied; this does (untimed), so that work does not run beside the baseline after it
    pair.dst.wait_adoptions()
    return dt, placed.offset, got.offset


def raw_socket(src: memoryview, dst: memoryview) -> float:
    """One loopback TCP connection moving ``src`` into ``dst`` (sendall / recv_into)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    done = threading.Event()

    def receive() -> None:
        conn, _ = server.accept()
        with conn:
            got, n = 0, len(dst)
            while got < n:
                k = conn.recv_into(dst[got:], n - got)
                if not k:
                    break
                got += k
        done.set()

    t = threading.Thread(target=receive)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        t0 = time.perf_counter()
        c.sendall(src)
        done.wait()
        dt = time.perf_counter() - t0
    t.join()
    server.close()
    return dt


def memcpy(src: memoryview, dst: memoryview) -> float:
    t0 = time.perf_counter()
    dst[:] = src
    return time.perf_counter() - t0


# larger than this machine's last-level cache (32 MiB here): written through before a cold copy
_EVICT = np.zeros(96 << 20, np.uint8)


def memcpy_cold(src: memoryview, dst: memoryview) -> float:
    """The same copy with neither side in the caches. The plain baseline runs right after the
    pull copied the same bytes, so at 2-8 MiB both sides sit in the last-level cache (its
    GB/s are the cache's); the bytes a real pull reads were written by the prefill engine a
    while before, in another process. Measured after a size's pulls (see ``run_transport``)."""
    np.add(_EVICT, 1, out=_EVICT)
    return memcpy(src, dst)


def run_transport(
    tmp: Path, transport: str, sizes: list[int], reps: int, streams: int
) -> dict[int, tuple[float, float, float]]:
    """-> {size: (transport GB/s, baseline GB/s, cold-cache memcpy GB/s (shm; else 0))}"""
    # room for a pull, the client's grant (<= MAX_GRANT_BYTES) and the next export meanwhile
    pair = Pair(tmp, transport, max(sizes) + 2 * MAX_GRANT_BYTES, streams)
    out = {}
    try:
        state: dict[str, Any] = {}
        for size in sizes:
            times, base, cold = [], [], []
            n = reps if size >= 64 << 20 else max(reps, SMALL_REPS)
            for rep in range(n):
                dt, so, do = pull_once(pair, size, state, verify=rep == 0)
                times.append(dt)
                a = pair.src.region().view(so, size)
                b = pair.dst.region().view(do, size)
                base.append(raw_socket(a, b) if transport == "tcp" else memcpy(a, b))
                a.release()
                b.release()
            if transport == "shm":
                # after the pulls, not between them: evicting the caches before a pull would
                # evict the code of both sidecars and of the client too (a cold-started pull,
                # slower by ~0.2 ms here, which the plain memcpy beside it never pays)
                a = pair.src.region().view(so, size)
                b = pair.dst.region().view(do, size)
                cold = [memcpy_cold(a, b) for _ in range(n)]
                a.release()
                b.release()
            out[size] = (
                size / min(times) / GB,
                size / min(base) / GB,
                size / min(cold) / GB if cold else 0.0,
            )
            print(
                f"  {transport:4} {size >> 20:6d} MiB: {out[size][0]:6.2f} GB/s "
                f"(baseline {out[size][1]:6.2f}); runs "
                + " ".join(f"{t * 1e3:.1f}" for t in times)
                + " ms, baseline "
                + " ".join(f"{t * 1e3:.1f}" for t in base)
                + " ms",
                file=sys.stderr,
            )
    finally:
        pair.close()
    return out


def kv_sizes(config: dict[str, Any], itemsize: int) -> dict[str, float]:
    """Paged KV bytes per token, fixed per-sequence bytes, and a 4K prompt's total, from the
    model layer's own cache sizing."""
    from dsv4_serving.attention.kv_cache.v4 import V4KVCache
    from dsv4_serving.models.config import DeepseekV4Config

    cfg = DeepseekV4Config.from_dict(config)
    # the engine's rule: the smallest multiple of both compression ratios that is >= 16
    unit = math.lcm(cfg.csa_ratio, cfg.hca_ratio)
    bs = unit * max(1, -(-16 // unit))
    per_block = V4KVCache.bytes_per_block(cfg, bs, itemsize)
    per_slot = V4KVCache.bytes_per_slot(cfg, itemsize)
    prompt = 4096
    return {
        "block_size": bs,
        "per_token": per_block / bs,
        "per_seq": per_slot,
        "prompt_4k": -(-prompt // bs) * per_block + per_slot,
    }


def _prefill_engine(tmp: Path, prompt: int) -> tuple[SidecarService, Any]:
    """A real sidecar and, in this process, a dsv4-tiny prefill engine using it."""
    from dsv4_serving.engine.config import EngineConfig
    from dsv4_serving.engine.engine.engine_core import EngineCore

    proc = SidecarService(
        "engine-export",
        tmp / "engine-export.log",
        tmp / "token",
        free_ports(3, set()),
        staging_bytes=256 << 20,
        shm_name=f"dsv4-kv-bench-{os.getpid()}-engine",
        log_level="warning",
        # its exports are never pulled: exit (and unlink the region) at once on SIGTERM
        shutdown_timeout=0,
    )
    proc.start()
    proc.wait_ready(60)
    core = EngineCore(
        EngineConfig(
            model="dsv4-tiny",
            load_format="dummy",
            dtype="float32",
            role="prefill",
            kv_sidecar=proc.url,
            max_model_len=prompt + 16,
            max_num_seqs=4,
            enable_prefix_caching=False,
        )
    )
    return proc, core


def engine_export(tmp: Path, requests: int, prompt: int) -> dict[str, float]:
    """A prefill engine (``dsv4-tiny``, in this process) beside a real sidecar: each request is
    prefilled alone and its KV exported for a remote decode. -> mean milliseconds of the prefill
    step, of its forward, of the rest of that step, and of the export (reserve, copy, commit),
    which runs on the connector's thread while the engine steps on."""
    from dsv4_kvtransfer.pd_protocol import PrefillRequestParams
    from dsv4_serving.engine.request import EngineCoreRequest
    from dsv4_serving.engine.sample.sampling_params import SamplingParams

    proc, core = _prefill_engine(tmp, prompt)
    forward: list[float] = []
    execute = core.runner.execute

    def timed(*args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return execute(*args, **kw)
        finally:
            forward.append(time.perf_counter() - t)

    core.runner.execute = timed  # type: ignore[method-assign]
    rng = np.random.default_rng(1)
    steps, fwd, exports = [], [], []
    try:
        for i in range(requests + 1):  # the first warms up
            ids = [int(x) for x in rng.integers(1, 200, prompt)]
            sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            core.add_request(
                EngineCoreRequest(f"x{i}", ids, sp, kv_transfer_params=PrefillRequestParams())
            )
            forward.clear()
            t = time.perf_counter()
            core.step()  # the whole prompt in one step: its forward, then the export starts
            step = time.perf_counter() - t
            f = forward[0]
            params = None
            while core.has_unfinished_requests():  # the response waits for the commit
                for o in core.step():
                    params = o.kv_transfer_params
                    if o.error is not None:
                        raise SystemExit(f"export failed: {o.error.message}")
                if params is None:
                    core.wait_for_kv(0.02)
            if params is None:
                raise SystemExit("no kv_transfer_params in the prefill response")
            if i:
                steps.append(step)
                fwd.append(f)
        assert core.kv_scheduler is not None
        exports = core.kv_scheduler.stats.take().export_seconds[-requests:]
    finally:
        core.close()
        proc.stop(timeout_s=30)
    ms = 1e3 / requests
    return {
        "step": sum(steps) * ms,
        "forward": sum(fwd) * ms,
        "rest": (sum(steps) - sum(fwd)) * ms,
        "export": sum(exports) * ms,
    }


Results = dict[str, dict[int, tuple[float, float, float]]]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--sizes",
        nargs="+",
        type=parse_size,
        default=[2 << 20, 4 << 20, 8 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30],
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transports", nargs="+", default=["tcp", "shm"], choices=("tcp", "shm"))
    ap.add_argument(
        "--streams", type=int, default=4, help="TCP streams per pull (sidecar default 4)"
    )
    ap.add_argument(
        "--engine-export",
        type=int,
        default=4,
        metavar="N",
        help="prefill N requests in a dsv4-tiny prefill engine and time its steps beside the "
        "KV export (0: skip)",
    )
    return ap.parse_args()


def print_bandwidth(args: argparse.Namespace, results: Results) -> None:
    base_name = {"tcp": "raw socket", "shm": "memcpy"}
    small = max(args.reps, SMALL_REPS)
    print(
        f"\nKV transfer between two sidecars on 127.0.0.1 (best of {args.reps}, of {small} below "
        "64 MiB; GB/s = 1e9 B/s)"
    )
    head = f"{'size':>9}"
    for t in args.transports:
        head += f" | {t + ' GB/s':>10} | {base_name[t] + ' GB/s':>16} | {'ratio':>6}"
        if t == "shm":
            head += f" | {'cold memcpy':>11} | {'ratio':>6}"
    print(head)
    print("-" * len(head))
    for size in sorted(args.sizes):
        row = f"{size >> 20:>5} MiB"
        for t in args.transports:
            got, base, cold = results[t][size]
            row += f" | {got:10.2f} | {base:16.2f} | {got / base:6.0%}"
            if t == "shm":
                row += f" | {cold:11.2f} | {got / cold:6.0%}"
        print(row)
    if "shm" in args.transports:
        print(
            "(the goal's ratio is to memcpy, run right after the pull copied the same bytes: at "
            "2-8 MiB both sides are in the last-level cache; cold memcpy: the same copy after "
            "evicting the caches, as a pull's source bytes are)"
        )


def print_kv_sizes(args: argparse.Namespace, results: Results) -> None:
    print("\nDeepSeek V4 KV per request (the model layer's cache sizing)")
    models = [
        ("dsv4-tiny (float32)", preset_config("dsv4-tiny"), 4),
        ("DeepSeek-V4-Flash (bf16)", shape_config("deepseek-v4-flash"), 2),
    ]

    def bandwidth(t: str, nbytes: float) -> float:
        """GB/s measured at the smallest size that holds ``nbytes`` (fixed costs included)."""
        fits = [z for z in sorted(args.sizes) if z >= nbytes] or [max(args.sizes)]
        return results[t][fits[0]][0]

    head = f"{'model':<26} | {'block':>5} | {'paged B/token':>13} | {'per-seq state':>13} | {'4K prompt':>10}"
    for t in args.transports:
        head += f" | {'4K via ' + t:>10}"
    print(head)
    print("-" * len(head))
    for name, config, itemsize in models:
        s = kv_sizes(config, itemsize)
        row = (
            f"{name:<26} | {s['block_size']:>5} | {s['per_token']:>13,.0f} | "
            f"{s['per_seq'] / 2**20:>9.2f} MiB | {s['prompt_4k'] / 2**20:>6.1f} MiB"
        )
        for t in args.transports:
            row += f" | {s['prompt_4k'] / (bandwidth(t, s['prompt_4k']) * GB) * 1e3:>7.1f} ms"
        print(row)
    print(
        "\n(4K prompt = ceil(4096 / block) paged blocks + one sequence's window ring and "
        "compressor state; time at the bandwidth measured for the smallest size that holds it)"
    )


def print_engine_export(requests: int, exp: dict[str, float]) -> None:
    print(
        f"\nPrefill engine (dsv4-tiny, 256-token prompts, mean of {requests}): the "
        "step that prefills a prompt and starts its KV export, and the export itself"
    )
    print(f"{'prefill step':>14} | {'its forward':>11} | {'rest of step':>12} | {'KV export':>9}")
    print(
        f"{exp['step']:11.1f} ms | {exp['forward']:8.1f} ms | {exp['rest']:9.2f} ms | "
        f"{exp['export']:6.2f} ms"
    )
    print(
        "(the export - reserve, copy to staging, commit - runs on the connector's thread "
        "while the engine steps on: it is not part of the step)"
    )


def main() -> int:
    args = parse_args()
    results: Results = {}
    with tempfile.TemporaryDirectory(prefix="dsv4-kv-bench-") as d:
        tmp = Path(d)
        (tmp / "token").write_text("benchmark-token-" + os.urandom(16).hex())
        for t in args.transports:
            results[t] = run_transport(tmp, t, sorted(args.sizes), args.reps, args.streams)
        exp = engine_export(tmp, args.engine_export, 256) if args.engine_export else None
    print_bandwidth(args, results)
    print_kv_sizes(args, results)
    if exp is not None:
        print_engine_export(args.engine_export, exp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
