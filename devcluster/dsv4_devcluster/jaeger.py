"""A local Jaeger v2 (built by ``scripts/trace-backend``) as the trace backend of tests and of
a developer's ``dsv4 up --otlp-traces-endpoint``: an OTLP/HTTP receiver and the query API on
127.0.0.1, traces kept in memory.

    with Jaeger.start(bin_path, run_dir) as j:   # j.otlp_endpoint, j.query_url
        ...
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import TracebackType
from typing import Self

from dsv4_common.process import Service, free_ports

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "trace-backend"


def config_yaml(otlp_port: int, query_port: int, grpc_port: int, health_port: int) -> str:
    """Jaeger v2's collector config: OTLP/HTTP in, memory storage, query API out, no clock-skew
    adjustment (all our processes share one clock; an adjusted timestamp would hide a real
    ordering problem)."""
    return f"""\
service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    traces:
      level: none
    logs:
      level: warn
extensions:
  healthcheckv2:
    use_v2: true
    http:
      endpoint: 127.0.0.1:{health_port}
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
  jaeger_query:
    storage:
      traces: memstore
    max_clock_skew_adjust: 0s
    http:
      endpoint: 127.0.0.1:{query_port}
    grpc:
      endpoint: 127.0.0.1:{grpc_port}
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{otlp_port}
processors:
  batch:
    timeout: 100ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"""


def binary() -> Path:
    """The cached jaeger binary (``$DSV4_JAEGER_BIN``, else built on first use: minutes)."""
    r = subprocess.run([str(SCRIPT)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"scripts/trace-backend failed:\n{r.stderr[-2000:]}")
    return Path(r.stdout.strip().splitlines()[-1])


class Jaeger:
    def __init__(self, service: Service, otlp_port: int, query_port: int) -> None:
        self.service = service
        self.otlp_endpoint = f"http://127.0.0.1:{otlp_port}"
        self.query_url = f"http://127.0.0.1:{query_port}"

    @classmethod
    def start(cls, bin_path: Path, run_dir: Path, timeout_s: float = 60.0) -> Jaeger:
        base = free_ports(4, set())
        otlp, query, grpc, health = base, base + 1, base + 2, base + 3
        cfg = run_dir / "jaeger.yaml"
        cfg.write_text(config_yaml(otlp, query, grpc, health))
        svc = Service(
            "jaeger",
            [str(bin_path), "--config", str(cfg)],
            run_dir / "jaeger.log",
            f"http://127.0.0.1:{health}",
            health_path="/status",
        )
        svc.start()
        svc.wait_ready(timeout_s)
        return cls(svc, otlp, query)

    def stop(self) -> None:
        self.service.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
