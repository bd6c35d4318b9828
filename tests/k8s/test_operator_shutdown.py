"""The operator exits promptly on SIGTERM, even while its API server does not answer (a standby
replica takes over only once it is gone). Its own module: no other operator runs meanwhile."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import wait_for
from tests.k8s.blackhole import Blackhole
from tests.k8s.operator_fixtures import OperatorService, apply_yaml
from tests.k8s.test_operator import EXAMPLES, _children

EXIT_WITHIN_S = 10.0


@pytest.fixture
def dark_api(
    k8s_cluster: Any, operator_kubeconfig: Path, tmp_path: Path
) -> Iterator[tuple[Blackhole, Path]]:
    """A proxy to the API server and a copy of the operator's kubeconfig that goes through it."""
    config = json.loads(operator_kubeconfig.read_text())
    server = config["clusters"][0]["cluster"]["server"]
    proxy = Blackhole(int(server.rsplit(":", 1)[1]))
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    path = tmp_path / "through-proxy.kubeconfig"
    path.write_text(json.dumps(config))
    yield proxy, path
    proxy.close()


def test_sigterm_exits_within_10s_while_the_api_server_is_unreachable(
    k8s_cluster: Any, dark_api: tuple[Blackhole, Path]
) -> None:
    cluster, (proxy, kubeconfig) = k8s_cluster, dark_api
    ns = f"dark-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", ns)
    proc = OperatorService(kubeconfig, cluster.log_dir).launch()
    try:
        apply_yaml(cluster, (EXAMPLES / "tiny-cpu.yaml").read_text(), ns)
        wait_for("the operator at work", lambda: _children(cluster, ns, "tiny"), timeout_s=60)
        proxy.go_dark()
        # an edit the operator will never hear of, and time for its requests to hang
        cluster.kubectl("delete", "configmap", "tiny-engine", "-n", ns)
        time.sleep(2)
        assert proc.pid is not None and proc.running()
        start = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        exited = wait_for(
            "the operator to exit",
            lambda: proc.exit_code() is not None or None,
            timeout_s=EXIT_WITHIN_S + 20,
            every_s=0.1,
        )
        took = time.monotonic() - start
        assert exited and took < EXIT_WITHIN_S, f"exited after {took:.1f}s"
        assert proc.exit_code() == 0, proc.tail(40)
    finally:
        proc.stop(timeout_s=5)
        cluster.kubectl("delete", "namespace", ns, "--wait=false")
