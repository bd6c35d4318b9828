"""A rank that dies ends the instance cleanly: SIGKILL a TP follower of a running
``dsv4 engine --tensor-parallel-size 2`` mid-generation; within 30 s every in-flight request
gets a 503 naming the dead rank, the engine exits non-zero and no process of its group is
left. A node started with other sizes, and a node that never comes, stop the instance at the
rendezvous with a message naming what differs or what is missing."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dsv4_common.process import Service, dsv4_argv, free_port
from tests.engine.common import start_engine

from .processes import group_left, group_members

pytestmark = pytest.mark.dist


def _complete(url: str, results: list[tuple[int, dict[str, object]]]) -> None:
    body = {"model": "dsv4-tiny", "prompt": [5, 6, 7], "max_tokens": 360, "ignore_eos": True}
    req = urllib.request.Request(
        url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            results.append((r.status, json.loads(r.read())))
    except urllib.error.HTTPError as e:
        results.append((e.code, json.loads(e.read())))


def test_a_killed_follower_fails_requests_with_503_and_ends_the_instance(tmp_path: Path) -> None:
    server = start_engine(
        "tp2",
        tmp_path,
        *("--model", "dsv4-tiny", "--max-model-len", "384", "--num-kv-blocks", "200"),
        *("--tensor-parallel-size", "2", "--threads-per-rank", "1"),
    )
    try:
        server.wait_ready(180)
        pgid = server.pid
        assert pgid is not None
        ranks = {n: p for p, n in group_members(pgid).items() if n.startswith("dsv4-rank")}
        assert set(ranks) == {"dsv4-rank-0", "dsv4-rank-1"}
        results: list[tuple[int, dict[str, object]]] = []
        clients = [threading.Thread(target=_complete, args=(server.url, results)) for _ in range(3)]
        for c in clients:
            c.start()
        deadline = time.monotonic() + 60
        while server.metric("vllm:num_requests_running") < 3:
            assert time.monotonic() < deadline, "the requests never ran"
            time.sleep(0.1)
        os.kill(ranks["dsv4-rank-1"], signal.SIGKILL)
        killed = time.monotonic()
        for c in clients:
            c.join(timeout=30)
        while server.running() and time.monotonic() - killed < 30:
            time.sleep(0.1)
        took = time.monotonic() - killed
        print(f"instance ended {took:.1f} s after the kill; answers {results}")
        assert not server.running() and took < 30
        assert server.exit_code() == 1
        assert [status for status, _ in results] == [503, 503, 503]
        for _, body in results:
            err = body["error"]
            assert isinstance(err, dict)
            assert err["code"] == "engine_unavailable"
            assert "engine core died: rank" in str(err["message"])
        # a process may still be tearing down (empty cmdline, not yet a zombie) a moment after
        # the front end exits: gone within the same 30 s
        assert group_left(pgid, killed) == {}
        assert "engine core died" in server.tail(80)
    finally:
        server.stop()


def _ended(s: Service, within_s: float) -> float:
    t = time.monotonic()
    while s.running() and time.monotonic() - t < within_s:
        time.sleep(0.1)
    return time.monotonic() - t


def test_a_node_with_other_sizes_and_a_missing_node_end_with_readable_errors(
    tmp_path: Path,
) -> None:
    """Node 1 started with DP 2 against node 0's TP 2: both nodes stop at the rendezvous with
    the two shapes named (not a timeout). Node 0 without its node 1: the rendezvous timeout
    names node 1's rank. Neither hangs."""
    port = free_port()
    tiny = ["--model", "dsv4-tiny", "--max-model-len", "256", "--threads-per-rank", "1"]
    nodes = ["--nnodes", "2", "--master-port", str(port), "--distributed-timeout", "60"]
    node0 = start_engine("node0", tmp_path, *tiny, *nodes, "--tensor-parallel-size", "2")
    http = free_port()
    argv = dsv4_argv(
        "engine",
        "--headless",
        "--host",
        "127.0.0.1",
        "--port",
        str(http),
        *tiny,
        *nodes,
        *("--node-rank", "1", "--master-addr", "127.0.0.1"),
        *("--tensor-parallel-size", "2", "--data-parallel-size", "2"),
    )
    node1 = Service("node1", argv, tmp_path / "node1.log", f"http://127.0.0.1:{http}")
    node1.start(env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    lonely = start_engine(
        "lonely",
        tmp_path,
        *tiny,
        "--tensor-parallel-size",
        "2",
        *("--nnodes", "2", "--master-port", str(free_port()), "--distributed-timeout", "3"),
    )
    try:
        for s in (node0, node1, lonely):
            took = _ended(s, 60)
            print(f"{s.name} ended after {took:.1f} s more")
            assert not s.running(), f"{s.name} still running:\n{s.tail()}"
            assert s.exit_code() != 0
        shapes = (
            "runs world 4 (tp 2 x dp 2 over 2 node(s)) but rank 0 runs world 2 (tp 2 x dp 1 "
            "over 2 node(s)); every node of an instance needs the same --tensor-parallel-size"
        )
        assert "world size mismatch" in node0.tail(80) and shapes in node0.tail(80)
        assert shapes in node1.tail(80)
        assert (
            "timed out after 3 s: ranks 1 (node 1) of world 2 (tp 2 x dp 1 over 2 nodes) "
            "never joined" in lonely.tail(80)
        )
    finally:
        for s in (node0, node1, lonely):
            s.stop()
