"""After the tier's own cluster is gone (``after_the_tier(2)``, after test_host_left_clean.py): a `dsv4 dev-cluster
--real-nodes 1` killed with SIGKILL, a pod running, leaves shims, cgroups, bridges, mounts and
iptables chains; the next start's `revert_stale()` removes all of it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.node.conftest import RealClusterHandle, busybox_pod


@pytest.mark.after_the_tier(2)
def test_a_killed_dev_cluster_is_reverted_at_the_next_start(real_handle: RealClusterHandle) -> None:
    from dsv4_devcluster.realnodes import hoststate

    real_handle.get()  # skips, with the reason, where real nodes cannot run
    assert real_handle.close() == {}
    before = hoststate.snapshot()
    with tempfile.TemporaryDirectory(prefix="dsv4-crash-") as tmp:
        work = Path(tmp)
        log = (work / "dev-cluster.log").open("w")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dsv4_common.cli",
                "dev-cluster",
                "--real-nodes",
                "1",
                "--nodes",
                "0",
                "--work-dir",
                str(work / "c"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 180
            while "Ctrl-C stops" not in (work / "dev-cluster.log").read_text():
                assert proc.poll() is None, (work / "dev-cluster.log").read_text()
                assert time.monotonic() < deadline, (work / "dev-cluster.log").read_text()
                time.sleep(0.5)
            kubectl = [
                str(real_handle.real.bin_dir / "kubectl"),
                "--kubeconfig",
                str(work / "c" / "admin.kubeconfig"),
            ]
            pod = busybox_pod("victim", "exec sleep 3600")
            subprocess.run(
                [*kubectl, "apply", "-f", "-"], input=json.dumps(pod), text=True, check=True
            )
            subprocess.run(
                [*kubectl, "wait", "--for=condition=Ready", "--timeout=120s", "pod/victim"],
                check=True,
                capture_output=True,
            )
        finally:
            os.kill(proc.pid, signal.SIGKILL)  # a crashed test run: no teardown at all
            proc.wait()
        time.sleep(1)
        left = hoststate.diff(before, hoststate.snapshot())
        assert left, "a killed cluster should have left something (a pod's shim at least)"
        assert hoststate.revert_stale() == []
        assert hoststate.diff(before, hoststate.snapshot()) == {}
