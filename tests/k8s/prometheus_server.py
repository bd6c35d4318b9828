"""A real Prometheus (Debian's ``prometheus``, 2.42) on 127.0.0.1 for the autoscaler's
Prometheus source: it scrapes the metrics stub every second under the labels the chart's
PodMonitor gives the gateway and engine pods (``dsv4_deployment``, ``namespace``,
``component``, ``role``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from dsv4_common.process import Service, free_port

BINARY = "prometheus"


def available() -> bool:
    return shutil.which(BINARY) is not None


class PrometheusService(Service):
    def __init__(self, work_dir: Path, target: str, deployment: str, namespace: str) -> None:
        port = free_port()
        base = {"dsv4_deployment": deployment, "namespace": namespace}
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {
                    "job_name": f"dsv4-{name}",
                    "honor_labels": True,
                    "static_configs": [{"targets": [target], "labels": {**base, **labels}}],
                }
                for name, labels in (
                    ("gateway", {"component": "gateway"}),
                    ("prefill", {"component": "engine", "role": "prefill"}),
                    ("decode", {"component": "engine", "role": "decode"}),
                )
            ],
        }
        work_dir.mkdir(parents=True, exist_ok=True)
        cfg = work_dir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        argv = [
            BINARY,
            f"--config.file={cfg}",
            f"--storage.tsdb.path={work_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        super().__init__(
            "prometheus",
            argv,
            work_dir / "prometheus.log",
            url=f"http://127.0.0.1:{port}",
            health_path="/-/ready",
        )
