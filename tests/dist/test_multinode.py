"""Two "nodes" of one instance as process trees on 127.0.0.1: node 0 is ``dsv4 engine
--nnodes 2``, node 1 is ``dsv4 engine --headless`` configured the way the operator renders a
follower pod (``DSV4_NODE_RANK``, ``DSV4_NODES_PER_INSTANCE``, ``DSV4_MASTER_ADDR`` and the
rendezvous port). TP 2 x DP 2 (EP 4): each node holds one DP rank's TP group (shared-memory
collectives inside a node, gloo across). The greedy tokens equal one process's, requests pinned
to DP rank 1 run on node 1, and stopping node 0 ends node 1 cleanly. Losing node 1 mid-
generation ends node 0 within 30 s: 503s, exit 1, no process left."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from dsv4_common.process import Service, dsv4_argv, free_port
from tests.engine.common import start_engine, workload

from .processes import greedy_tokens, group_left

pytestmark = pytest.mark.dist

COMMON = [
    *("--model", "dsv4-tiny", "--max-model-len", "384", "--num-kv-blocks", "200"),
    *("--threads-per-rank", "1", "--num-speculative-tokens", "1", "--log-level", "WARNING"),
]
SHAPE = ["--tensor-parallel-size", "2", "--data-parallel-size", "2", "--expert-parallel-size", "4"]
ITEMS = workload(6, 5, shared_prefix=12)


def _follower(tmp: Path, port: int) -> Service:
    http = free_port()
    argv = dsv4_argv(
        "engine", "--headless", "--host", "127.0.0.1", "--port", str(http), *COMMON, *SHAPE
    )
    s = Service("node1", argv, tmp / "engine-node1.log", f"http://127.0.0.1:{http}")
    s.start(
        env={
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "DSV4_NODE_RANK": "1",
            "DSV4_NODES_PER_INSTANCE": "2",
            "DSV4_MASTER_ADDR": "127.0.0.1",
            "DSV4_MASTER_PORT": str(port),
        }
    )
    return s


def test_two_nodes_with_a_headless_follower_give_one_process_tokens(tmp_path: Path) -> None:
    port = free_port()
    ref = start_engine("ref", tmp_path, *COMMON)
    node0 = start_engine(
        "node0", tmp_path, *COMMON, *SHAPE, "--nnodes", "2", "--master-port", str(port)
    )
    node1 = _follower(tmp_path, port)
    try:
        for s in (ref, node0, node1):
            s.wait_ready(240)
        assert node1.metric("dsv4_headless_ranks_alive", node_rank="1") == 2
        assert httpx.get(node1.url + "/ready").status_code == 200
        assert httpx.get(node1.url + "/v1/models").status_code == 404  # the API is node 0's
        with ThreadPoolExecutor(6) as pool:
            want = list(pool.map(lambda it: greedy_tokens(ref.url, *it), ITEMS))
            wave = pool.map(lambda it: greedy_tokens(node0.url, *it, rank=1), ITEMS[:3])
            # the pinned wave runs on DP rank 1, whose ranks are node 1's
            seen = {"0": 0.0, "1": 0.0}
            deadline = time.monotonic() + 60
            while seen["1"] == 0 and time.monotonic() < deadline:
                for r in seen:
                    seen[r] = max(seen[r], node0.metric("vllm:num_requests_running", engine=r))
                time.sleep(0.02)
            got = list(wave) + list(pool.map(lambda it: greedy_tokens(node0.url, *it), ITEMS[3:]))
        assert got == want
        assert seen["0"] == 0 and seen["1"] > 0, seen
        pgid = node1.pid
        assert pgid is not None
        assert node0.pid is not None
        os.kill(node0.pid, signal.SIGTERM)  # what a pod's stop sends: its main process only
        stopped = time.monotonic()
        deadline = stopped + 30
        while (node0.running() or node1.running()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert node1.exit_code() == 0, node1.tail()
        assert node0.exit_code() == 0
        assert group_left(pgid, stopped) == {}
    except BaseException:
        for s in (node0, node1):
            print(f"--- {s.name} ---\n{s.tail(60)}")
        raise
    finally:
        for s in (ref, node0, node1):
            s.stop()


def test_a_lost_follower_node_ends_the_instance_with_503s(tmp_path: Path) -> None:
    port = free_port()
    node0 = start_engine(
        "node0", tmp_path, *COMMON, *SHAPE, "--nnodes", "2", "--master-port", str(port)
    )
    node1 = _follower(tmp_path, port)
    try:
        for s in (node0, node1):
            s.wait_ready(240)
        body = {"model": "dsv4-tiny", "prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:
            answers = [
                pool.submit(httpx.post, node0.url + "/v1/completions", json=body, timeout=60)
                for _ in range(2)
            ]
            deadline = time.monotonic() + 60
            while node0.metric("vllm:num_requests_running") < 2:
                assert time.monotonic() < deadline, "the requests never ran"
                time.sleep(0.05)
            assert node1.pid is not None
            os.killpg(node1.pid, signal.SIGKILL)  # the whole node: its headless process and ranks
            killed = time.monotonic()
            codes = [a.result().status_code for a in answers]
        while node0.running() and time.monotonic() - killed < 30:
            time.sleep(0.1)
        print(f"node 0 ended {time.monotonic() - killed:.1f} s after node 1 was killed")
        assert codes == [503, 503]
        assert not node0.running() and node0.exit_code() == 1
        assert node0.pid is not None
        assert group_left(node0.pid, killed) == {}
    except BaseException:
        for s in (node0, node1):
            print(f"--- {s.name} ---\n{s.tail(60)}")
        raise
    finally:
        for s in (node0, node1):
            s.stop()
