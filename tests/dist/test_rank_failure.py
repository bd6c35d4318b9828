"""A rank that dies ends the instance cleanly: SIGKILL a TP follower of a running
``dsv4 engine --tensor-parallel-size 2`` mid-generation; within 30 s every in-flight request
gets a 503 naming the dead rank, the engine exits non-zero and no process of its group is
left."""

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

from tests.engine.common import start_engine

pytestmark = pytest.mark.dist


def _group_members(pgid: int) -> dict[int, str]:
    """Live (non-zombie) processes of process group ``pgid``: pid -> kernel name."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        state, _ppid, group = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(group) == pgid and state != "Z":
            out[int(d.name)] = name
    return out


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
        ranks = {n: p for p, n in _group_members(pgid).items() if n.startswith("dsv4-rank")}
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
        while _group_members(pgid) and time.monotonic() - killed < 30:
            time.sleep(0.1)
        assert _group_members(pgid) == {}
        assert "engine core died" in server.tail(80)
    finally:
        server.stop()
