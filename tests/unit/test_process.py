"""The one process helper: process groups, dying with the parent, logs, ports, services."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv4_common.process import ManagedProcess, Service, free_port, free_ports, metric_value

pytestmark = pytest.mark.unit


def test_stop_kills_the_whole_process_group(tmp_path: Path) -> None:
    # A shell that ignores SIGTERM and has a child: stop() must leave neither behind.
    pid_file = tmp_path / "child.pid"
    script = f"trap '' TERM; sleep 300 & echo $! > {pid_file}; wait"
    proc = ManagedProcess("stubborn", ["bash", "-c", script], tmp_path / "log")
    proc.start()
    deadline = time.monotonic() + 60  # a hang, not a slow machine
    # the shell creates the file before it writes the pid: wait for the whole line
    while not (pid_file.exists() and pid_file.read_text().endswith("\n")):
        assert time.monotonic() < deadline, "the shell never wrote its child's pid"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    proc.stop(timeout_s=1.0)
    assert not proc.running()
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    """Running, not merely a zombie waiting for init to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_log_tail_and_exit_code(tmp_path: Path) -> None:
    proc = ManagedProcess(
        "echo", ["bash", "-c", "for i in 1 2 3; do echo line$i; done; exit 3"], tmp_path / "l.log"
    )
    proc.start()
    deadline = time.monotonic() + 10
    while proc.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.exit_code() == 3
    assert proc.tail(2) == "line2\nline3"


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_port_differs_between_calls() -> None:
    assert len({free_port() for _ in range(5)}) > 1


def test_child_dies_with_parent(tmp_path: Path) -> None:
    # The parent python starts a managed `sleep` and is then SIGKILLed: no orphan may remain.
    code = (
        "import sys, time; sys.path[:0] = sys.argv[1:2];"
        "from pathlib import Path;"
        "from dsv4_common.process import ManagedProcess;"
        f"p = ManagedProcess('s', ['sleep', '300'], Path({str(tmp_path / 's.log')!r})); p.start();"
        "print(p.pid, flush=True); time.sleep(300)"
    )
    import dsv4_common

    pkg_root = str(Path(dsv4_common.__file__).parents[1])
    parent = subprocess.Popen(["python3", "-c", code, pkg_root], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(child):
        os.kill(child, 9)
        pytest.fail("managed child outlived its killed parent")


def test_free_ports_hands_out_consecutive_ports_never_taken_twice() -> None:
    taken: set[int] = set()
    a = free_ports(3, taken)
    b = free_ports(3, taken)
    assert taken == {a, a + 1, a + 2, b, b + 1, b + 2}
    assert len(taken) == 6


def test_metric_value_sums_matching_samples() -> None:
    text = (
        "# TYPE req counter\n"
        'req_total{role="prefill",ok="1"} 2\n'
        'req_total{role="decode",ok="1"} 3\n'
        'req_total{role="decode",ok="0"} 4\n'
    )
    assert metric_value(text, "req_total") == 9
    assert metric_value(text, "req_total", role="decode") == 7
    assert metric_value(text, "req_total", role="decode", ok="0") == 4
    assert metric_value(text, "absent_total") == 0


def test_service_waits_for_health_and_reads_metrics(tmp_path: Path) -> None:
    port = free_port()
    server = (
        "import http.server, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        body = b'up_total 5\\n' if self.path == '/metrics' else b'ok'\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    svc = Service(
        "h", [sys.executable, "-c", server], tmp_path / "h.log", f"http://127.0.0.1:{port}"
    )
    svc.start()
    try:
        assert svc.wait_ready(timeout_s=20) is svc
        assert svc.metric("up_total") == 5
    finally:
        svc.stop()
    assert not svc.healthy()


def test_service_that_exits_fails_with_its_log(tmp_path: Path) -> None:
    svc = Service(
        "x",
        [sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
        tmp_path / "x.log",
        "http://127.0.0.1:1",
    )
    svc.start()
    with pytest.raises(RuntimeError, match=r"(?s)exited 3.*boom"):
        svc.wait_ready(timeout_s=20)


def test_a_self_chosen_port_never_comes_from_the_ephemeral_range() -> None:
    from dsv4_common.process import ephemeral_range, free_port_below_ephemeral

    lo, hi = ephemeral_range()
    assert 1024 <= lo < hi
    ports = {free_port_below_ephemeral() for _ in range(20)}
    assert all(max(1024, lo - 12000) <= p < lo for p in ports)


def test_a_port_range_splits_between_the_two_pickers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under DSV4_PORT_RANGE (runs side by side), ``free_port`` and ``free_ports`` pick from
    its lower two thirds, ``free_port_below_ephemeral`` from the rest; none twice lately."""
    from dsv4_common.process import free_port_below_ephemeral, port_range

    monkeypatch.setenv("DSV4_PORT_RANGE", "41000-41299")
    assert port_range() == (41000, 41299)
    low = [free_port() for _ in range(60)]
    assert all(41000 <= p < 41200 for p in low) and len(set(low)) == 60
    base = free_ports(4, set())
    assert base >= 41000 and base + 4 <= 41200 and not set(range(base, base + 4)) & set(low)
    assert all(41200 <= free_port_below_ephemeral() <= 41299 for _ in range(20))


@pytest.mark.parametrize("raw", ["41000", "a-b", "41000-41010", "80-1000", "60000-70000"])
def test_a_malformed_port_range_is_an_error_naming_it(raw: str) -> None:
    from dsv4_common.process import port_range

    with pytest.raises(ValueError, match="DSV4_PORT_RANGE"):
        port_range({"DSV4_PORT_RANGE": raw})
