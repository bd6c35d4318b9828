"""``dsv4 operator`` as a child process, for the k8s tests and the operator benchmark: a
``Service`` whose health is kopf's liveness endpoint and whose metrics are the operator's."""

from __future__ import annotations

from pathlib import Path

from dsv4_common.process import Service, dsv4_argv, free_port


class OperatorService(Service):
    def __init__(self, kubeconfig: Path, log_dir: Path, extra: tuple[str, ...] = ()) -> None:
        self.health_port, self.metrics_port = free_port(), free_port()
        argv = dsv4_argv(
            "operator",
            "--kubeconfig",
            str(kubeconfig),
            "--health-port",
            str(self.health_port),
            "--metrics-port",
            str(self.metrics_port),
            *extra,
        )
        super().__init__(
            "operator",
            argv,
            log_dir / f"operator-{self.metrics_port}.log",
            url=f"http://127.0.0.1:{self.metrics_port}",
        )
        # kopf serves liveness on its own port
        self.health_url = f"http://127.0.0.1:{self.health_port}/healthz"

    def launch(self, timeout_s: float = 60.0) -> OperatorService:
        """Start and wait until kopf reports it alive."""
        self.start(env={"PYTHONUNBUFFERED": "1"})
        return self.wait_ready(timeout_s)
