"""Engines as local processes behind kwok pods, for the autoscaler on the real control plane
(``tests/k8s/test_autoscaling_processes.py`` and ``benchmarks/autoscaling.py``).

kwok runs the pods the operator creates but no process behind them. ``ProcessNodes`` plays the
kubelet for one DeepSeekV4Deployment: for every prefill/decode instance StatefulSet whose rank-0
pod the scheduler has bound (as a kubelet starts only bound pods) it starts a real ``dsv4
engine`` (real or EMULATED step time) with its ``dsv4 kv-sidecar`` on 127.0.0.1 (the one launcher,
``dsv4_serving.commands.launch``), and, once the engine is healthy, publishes it in an EndpointSlice of its role (one slice per
instance, the engine's port, target pod ``<instance>-0``; the gateway's test-only
``--endpoint-host 127.0.0.1`` stands for the address, which slices refuse as loopback). One real
``dsv4 gateway`` watches those slices and the operator's ``<name>-routing`` ConfigMap with the
operator's own gateway RBAC. An address map file (the operator's ``--autoscaler-address-map``)
tells the operator which local address plays which pod port: the gateway pod's 8000, each
instance's engine (8000) and sidecar metrics port. When a StatefulSet is deleted, its slice
goes and its processes get SIGTERM (the engine's own drain is the backstop); just before that,
what the victim still held is read and kept (``Instance.at_stop``), so a test can tell whether
the operator deleted an instance that was still busy (the backstop would hide it otherwise).

Slices of the role Services that the endpointslice controller writes point at kwok IPs; the
gateway's selector (``dsv4.test/process=true``) leaves them out.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, config

from dsv4_common.ports import ENGINE_PORT
from dsv4_common.process import Service, dsv4_argv, free_port
from dsv4_kvtransfer.launch import SidecarService
from dsv4_serving.commands.launch import TINY_ENGINE, engine_with_sidecar

log = logging.getLogger(__name__)

PROCESS_LABEL = "dsv4.test/process"
SLICE_ADDRESS = "203.0.113.1"
"""What the slices say (they refuse loopback IPs; TEST-NET-3, never contacted): the gateway
runs with ``--endpoint-host 127.0.0.1`` (tests only), which replaces every slice address."""
_ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
_PORTS: set[int] = set()  # every instance's ports, never handed out twice


@dataclass
class Instance:
    name: str  # the StatefulSet
    role: str
    engine: Service
    sidecar: SidecarService
    started_at: float
    """Epoch seconds the processes were started."""
    scheduled_at: float | None = None
    """When this kubelet first saw the rank-0 pod bound to a node (0.3 s polling)."""
    ready_at: float | None = None
    published: bool = False
    at_ready: dict[str, float] = field(default_factory=dict)
    """The sidecar's staging gauges once the engine was healthy (``_STOP_GAUGES``' sidecar half)."""
    at_stop: dict[str, float] = field(default_factory=dict)
    """What the instance held just before its SIGTERM: engine running/waiting, sidecar exports,
    imports, staging free bytes (and KV bytes moved so far); empty when a read failed."""


_ENGINE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
_SIDECAR_GAUGES = (
    "dsv4_kv_active_exports",
    "dsv4_kv_active_imports",
    "dsv4_kv_staging_free_bytes",
    "dsv4_kv_staging_bytes",
    "dsv4_kv_transfer_bytes_total",  # a counter: KV bytes sent (prefill) or received (decode)
)


@dataclass
class ProcessNodes:
    cluster: Any
    namespace: str
    deployment: str
    token_file: Path
    log_dir: Path
    engine_args: list[str]
    sidecar_metrics_port: int
    """The CR's ``kvTransfer.port + 2``: where the operator reads a prefill's held exports."""
    sidecar_settings: dict[str, object] = field(default_factory=dict)
    """More ``SidecarConfig`` settings for every sidecar."""
    instance_sidecar_settings: dict[str, dict[str, object]] = field(default_factory=dict)
    """Settings for the sidecar of one instance (StatefulSet name), over ``sidecar_settings``:
    e.g. ``send_rate`` to slow the pulls of one prefill instance only."""
    role_engine_args: dict[str, list[str]] = field(default_factory=dict)
    """More engine arguments for one role's instances, after ``engine_args``: what the operator
    renders on that role's pods only (e.g. ``--prompt-deadline`` on prefill)."""
    gateway_kubeconfig: Path | None = None
    instances: dict[str, Instance] = field(default_factory=dict)
    history: list[tuple[float, str, str]] = field(default_factory=list)
    """(epoch s, instance, what): "created" (StatefulSet first seen), "scheduled" (rank-0 pod
    first seen bound), "started" (processes started), "ready" (engine healthy, then published),
    "stopped" (StatefulSet gone, processes stopped)."""

    def __post_init__(self) -> None:
        self.address_map = self.log_dir / f"address-map-{self.deployment}.json"
        self.address_map.write_text("{}")
        self._api = config.new_client_from_config(config_file=str(self.cluster.kubeconfig))  # type: ignore[no-untyped-call]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-nodes", daemon=True)
        self.gateway: Service | None = None
        self._gateway_pod: str | None = None
        self._seen: set[str] = set()

    # ---- lifecycle ---------------------------------------------------------------------------

    def start_gateway(self) -> Service:
        """The gateway, once the operator has created its ServiceAccount and Role."""
        deadline = time.monotonic() + 60
        while not self.cluster.kubectl(
            "get", "sa", f"{self.deployment}-gateway", "-n", self.namespace, check=False
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no ServiceAccount {self.deployment}-gateway after 60 s")
            time.sleep(0.5)
        kubeconfig = self.cluster.service_account_kubeconfig(
            self.namespace, f"{self.deployment}-gateway"
        )
        port = free_port()
        argv = dsv4_argv(
            "gateway",
            *("--host", "127.0.0.1", "--port", str(port)),
            *("--discovery", "kubernetes", "--kubeconfig", str(kubeconfig)),
            *("--namespace", self.namespace),
            *("--selector", f"app.kubernetes.io/instance={self.deployment},{PROCESS_LABEL}=true"),
            *("--routing-configmap", f"{self.deployment}-routing"),
            *("--endpoint-host", "127.0.0.1"),
            *("--health-interval", "0.5", "--log-level", "info"),
        )
        self.gateway = Service(
            f"{self.deployment}-gateway",
            argv,
            self.log_dir / f"{self.deployment}-gateway-{port}.log",
            f"http://127.0.0.1:{port}",
            health_path="/instances",
        )
        self.gateway.start(env=_ENV)
        self.gateway.wait_ready(60)
        return self.gateway

    def start(self) -> ProcessNodes:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for inst in list(self.instances.values()):
            self._kill(inst, read=False)  # not a deletion: nothing to check it held
        if self.gateway is not None:
            self.gateway.stop()

    # ---- the kubelet's loop ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            try:
                self.sync()
            except Exception:  # the loop must survive an API hiccup; the test sees the effect
                log.exception("process nodes: sync failed")

    def sync(self) -> None:
        apps = client.AppsV1Api(self._api)
        sel = f"app.kubernetes.io/instance={self.deployment}"
        # the client's models are read as plain objects (every field of theirs is Optional)
        sets: list[Any] = apps.list_namespaced_stateful_set(
            self.namespace, label_selector=sel
        ).items
        live = {s.metadata.name: s for s in sets}
        new = [
            (name, role)
            for name, sts in live.items()
            if (role := (sts.metadata.labels or {}).get("serving.dsv4.io/role"))
            in ("prefill", "decode")
            and name not in self.instances
        ]
        self._seen &= set(live)  # a name deleted and made again is a new instance
        for name, _ in new:
            if name not in self._seen:  # the operator's apply, as this kubelet sees it
                self._seen.add(name)
                self.history.append((time.time(), name, "created"))
        bound = self._bound_pods() if new else set()
        for name, role in new:
            if f"{name}-0" in bound:
                self._launch(name, role)
        for name, inst in list(self.instances.items()):
            if name not in live:
                self._kill(inst)
                continue
            if not inst.published and inst.engine.running() and inst.engine.healthy():
                inst.ready_at = time.time()
                self.history.append((inst.ready_at, name, "ready"))
                inst.at_ready = _read(inst.sidecar, _SIDECAR_GAUGES, "/metrics", inst)
                self._publish(inst)
        self._write_map()

    def _bound_pods(self) -> set[str]:
        pods: list[Any] = (
            client.CoreV1Api(self._api)
            .list_namespaced_pod(
                self.namespace, label_selector=f"app.kubernetes.io/instance={self.deployment}"
            )
            .items
        )
        return {p.metadata.name for p in pods if p.spec and p.spec.node_name}

    def _launch(self, name: str, role: str) -> None:
        engine_args = [*self.engine_args, *self.role_engine_args.get(role, [])]
        sidecar, engine = engine_with_sidecar(
            name,
            role,
            [*TINY_ENGINE, "--served-model-name", "tiny"],
            log_dir=self.log_dir,
            token_file=self.token_file,
            taken=_PORTS,
            shm_prefix="dsv4-as",
            engine_args=engine_args,
            **{**self.sidecar_settings, **self.instance_sidecar_settings.get(name, {})},
        )
        scheduled = time.time()
        self.history.append((scheduled, name, "scheduled"))
        sidecar.start(env=_ENV)
        engine.start(env=_ENV)
        now = time.time()
        self.instances[name] = Instance(name, role, engine, sidecar, now, scheduled)
        self.history.append((now, name, "started"))

    def _kill(self, inst: Instance, read: bool = True) -> None:
        if read:
            inst.at_stop = {
                **_read(inst.engine, _ENGINE_GAUGES, "/metrics", inst),
                **_read(inst.sidecar, _SIDECAR_GAUGES, "/metrics", inst),
            }
        if inst.published:
            with contextlib.suppress(client.ApiException):
                client.DiscoveryV1Api(self._api).delete_namespaced_endpoint_slice(
                    _slice_name(inst.name), self.namespace
                )
        inst.engine.stop(timeout_s=30)
        inst.sidecar.stop()
        self.instances.pop(inst.name, None)
        self.history.append((time.time(), inst.name, "stopped"))

    def _publish(self, inst: Instance) -> None:
        port = int(inst.engine.url.rsplit(":", 1)[1])
        body: Any = {  # the client takes a plain dict for its V1EndpointSlice
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": _slice_name(inst.name),
                "labels": {
                    "kubernetes.io/service-name": f"{self.deployment}-{inst.role}",
                    "app.kubernetes.io/instance": self.deployment,
                    "serving.dsv4.io/role": inst.role,
                    PROCESS_LABEL: "true",
                },
            },
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [
                {
                    "addresses": [SLICE_ADDRESS],
                    "conditions": {"ready": True, "serving": True},
                    "targetRef": {"kind": "Pod", "name": f"{inst.name}-0"},
                }
            ],
        }
        client.DiscoveryV1Api(self._api).create_namespaced_endpoint_slice(self.namespace, body)
        inst.published = True

    def _write_map(self) -> None:
        doc: dict[str, dict[str, str]] = {}
        for inst in self.instances.values():
            if inst.published:
                doc[f"{inst.name}-0"] = {
                    str(ENGINE_PORT): inst.engine.url.removeprefix("http://"),
                    str(self.sidecar_metrics_port): f"127.0.0.1:{inst.sidecar.metrics_port}",
                }
        if self.gateway is not None:
            pod = self._gateway_pod_name()
            if pod is not None:
                doc[pod] = {str(ENGINE_PORT): self.gateway.url.removeprefix("http://")}
        tmp = self.address_map.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.address_map)  # the operator never reads half a file

    def _gateway_pod_name(self) -> str | None:
        """One gateway pod (the operator sums the windows of every gateway pod it can read,
        and one process plays the gateway)."""
        if self._gateway_pod is None:
            pods: list[Any] = (
                client.CoreV1Api(self._api)
                .list_namespaced_pod(
                    self.namespace,
                    label_selector=f"app.kubernetes.io/instance={self.deployment},"
                    "serving.dsv4.io/role=gateway",
                )
                .items
            )
            running = sorted(
                p.metadata.name for p in pods if (p.status and p.status.phase) == "Running"
            )
            self._gateway_pod = running[0] if running else None
        return self._gateway_pod

    # ---- what the tests read -----------------------------------------------------------------

    def by_role(self, role: str) -> list[Instance]:
        return sorted((i for i in self.instances.values() if i.role == role), key=lambda i: i.name)


def _slice_name(instance: str) -> str:
    return f"{instance}-process"


def _read(svc: Service, names: tuple[str, ...], path: str, inst: Instance) -> dict[str, float]:
    """Gauges of a live process ({} if it does not answer: the reader sees a missing key)."""
    from dsv4_common.process import metric_value

    url = svc.url
    if isinstance(svc, SidecarService):  # the sidecar's gauges are on its metrics port
        url = f"http://127.0.0.1:{svc.metrics_port}"
    try:
        with urllib.request.urlopen(url + path, timeout=5) as r:
            text = r.read().decode()
    except OSError as e:
        log.warning("process nodes: %s unreadable before stop: %s", inst.name, e)
        return {}
    return {n: metric_value(text, n) for n in names}
