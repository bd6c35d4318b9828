"""Start and stop a local Kubernetes control plane made of real binaries on 127.0.0.1.

Two stages, so a test session pays only for what it uses:
- ``start()``: etcd + kube-apiserver (TLS, client-certificate auth, RBAC) and an admin kubeconfig;
- ``start_workloads(n)``: kube-controller-manager, kube-scheduler and kwok with ``n`` fake Ascend
  nodes, so Deployments get pods, pods get scheduled and are reported Running, and owners
  garbage-collect their dependents.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dsv4_common.process import ManagedProcess, free_port
from dsv4_devcluster.certs import CertPair, LocalPKI
from dsv4_devcluster.kwok_nodes import (
    KWOK_ANNOTATION,
    KWOK_ANNOTATION_VALUE,
    FakeNodeSpec,
    fake_node,
)

REQUIRED_BINARIES = ("etcd", "kube-apiserver", "kubectl")
WORKLOAD_BINARIES = ("kube-controller-manager", "kube-scheduler", "kwok")
SERVICE_CIDR = "10.96.0.0/16"
KWOK_STAGES = Path(__file__).with_name("kwok-stages.yaml")


class ClusterError(RuntimeError):
    """The local control plane could not be started; the message carries the component's log."""


@dataclass
class ClusterConfig:
    bin_dir: Path
    """Directory holding etcd, kube-apiserver, kubectl (and the workload binaries)."""
    work_dir: Path
    """Scratch directory: etcd data, certificates, kubeconfigs, logs."""
    startup_timeout_s: float = 120.0
    """How long each component may take to become ready."""
    node_spec: FakeNodeSpec = field(default_factory=FakeNodeSpec)
    """What each fake node advertises (NPU resource name and count, cpu, memory, labels)."""
    bind_address: str = "127.0.0.1"
    """Where the apiserver listens. Real nodes need a non-loopback address that pods reach: it is
    then advertised, so the ``kubernetes`` Service gets it as its endpoint (via kube-proxy)."""

    def __post_init__(self) -> None:
        missing = [b for b in REQUIRED_BINARIES if not (self.bin_dir / b).exists()]
        if missing:
            raise ClusterError(
                f"{self.bin_dir} lacks {', '.join(missing)}: run scripts/k8s-test-binaries "
                "(or set KUBEBUILDER_ASSETS / DSV4_K8S_BIN_DIR to a directory that has them)"
            )


def render_kubeconfig(server: str, ca: Path, client: CertPair, user: str) -> str:
    """A kubeconfig (JSON) for ``user``, who authenticates with the client certificate."""
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "dsv4-local",
                    "cluster": {"server": server, "certificate-authority": str(ca)},
                }
            ],
            "users": [
                {
                    "name": user,
                    "user": {
                        "client-certificate": str(client.cert),
                        "client-key": str(client.key),
                    },
                }
            ],
            "contexts": [
                {"name": "dsv4-local", "context": {"cluster": "dsv4-local", "user": user}}
            ],
            "current-context": "dsv4-local",
        },
        indent=2,
    )


class LocalCluster:
    """A control plane of real Kubernetes binaries; use as a context manager or start()/stop()."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.work_dir = config.work_dir
        self.log_dir = self.work_dir / "logs"
        self.processes: list[ManagedProcess] = []
        self.kubeconfig = self.work_dir / "admin.kubeconfig"
        self.server = ""
        self.nodes: list[str] = []
        self._pki: LocalPKI | None = None
        self._admin: CertPair | None = None
        self._sa: CertPair | None = None

    @property
    def pki(self) -> LocalPKI:
        """The cluster's CA: real nodes get their kubelet certificates from it."""
        assert self._pki is not None, "start() first"
        return self._pki

    # ---- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """etcd + kube-apiserver, ready to serve, with an admin kubeconfig in ``kubeconfig``."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_control_plane()
        except BaseException:
            self.stop()
            raise

    def start_workloads(self, nodes: int = 2) -> None:
        """Controller manager, scheduler, kwok and ``nodes`` fake Ascend nodes; idempotent."""
        if self.workloads_running():
            self.add_nodes(nodes - len(self.nodes))
            return
        missing = [b for b in WORKLOAD_BINARIES if not (self.config.bin_dir / b).exists()]
        if missing:
            raise ClusterError(f"{self.config.bin_dir} lacks {', '.join(missing)}")
        self._start_controller_manager()
        self._start_scheduler()
        self._start_kwok()
        self.add_nodes(nodes)
        # Pods need the namespace's default ServiceAccount, which the controller manager creates.
        self._wait("default ServiceAccount", lambda: self._kubectl_ok("get", "sa", "default"))

    def stop(self) -> None:
        """Stop every component, newest first (etcd last), and wait for each to exit."""
        for proc in reversed(self.processes):
            proc.stop()

    def workloads_running(self) -> bool:
        return any(p.name == "kwok" and p.running() for p in self.processes)

    def logs(self, lines: int = 40) -> str:
        """The tail of every component's log, for test failure reports."""
        return "\n".join(
            f"----- {p.name} (pid {p.pid}, exit {p.exit_code()}) {p.log_path}\n{p.tail(lines)}"
            for p in self.processes
        )

    # ---- kubectl -----------------------------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        """Run kubectl against this cluster and return stdout; raises with stderr on failure."""
        res = subprocess.run(
            [str(self.config.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check and res.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed: {res.stderr.strip()}")
        return res.stdout

    def helm(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        """Run helm against this cluster (its state under the work dir); the caller checks."""
        env = {
            "KUBECONFIG": str(self.kubeconfig),
            "HOME": str(self.work_dir),
            "PATH": os.environ.get("PATH", ""),
        }
        return subprocess.run(
            [str(self.config.bin_dir / "helm"), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
        )

    def install_chart(self, chart: Path, namespace: str, *args: str) -> str:
        """``helm install dsv4 CHART`` into ``namespace`` (created), then wait for the CRD."""
        res = self.helm("install", "dsv4", str(chart), "-n", namespace, "--create-namespace", *args)
        if res.returncode != 0:
            raise ClusterError(f"helm install failed: {res.stderr.strip()}")
        self.kubectl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/deepseekv4deployments.serving.dsv4.io",
        )
        return res.stdout

    def service_account_kubeconfig(self, namespace: str, account: str) -> Path:
        """A kubeconfig that authenticates as a ServiceAccount (a real token from the TokenRequest
        API), so a process run with it has exactly that account's RBAC."""
        token = self.kubectl("create", "token", account, "-n", namespace, "--duration=2h").strip()
        admin = json.loads(self.kubeconfig.read_text())
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": admin["clusters"],
            "users": [{"name": account, "user": {"token": token}}],
            "contexts": [
                {
                    "name": "sa",
                    "context": {"cluster": admin["clusters"][0]["name"], "user": account},
                }
            ],
            "current-context": "sa",
        }
        path = self.work_dir / f"sa-{namespace}-{account}.kubeconfig"
        path.write_text(json.dumps(cfg))
        return path

    def _kubectl_ok(self, *args: str) -> bool:
        return bool(self.kubectl(*args, check=False))

    def add_nodes(self, count: int) -> list[str]:
        """Register ``count`` more fake Ascend nodes and wait until kwok reports them Ready."""
        names = [f"ascend-node-{i}" for i in range(len(self.nodes), len(self.nodes) + count)]
        if not names:
            return []
        items = [fake_node(n, self.config.node_spec) for n in names]
        self.kubectl(
            "create",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
        )
        self.nodes.extend(names)
        timeout = f"{int(self.config.startup_timeout_s)}s"
        self.kubectl(
            "wait", "--for=condition=Ready", f"--timeout={timeout}", *(f"node/{n}" for n in names)
        )
        return names

    # ---- components --------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, self.log_dir / f"{name}.log")
        proc.start()
        self.processes.append(proc)
        return proc

    def _bin(self, name: str) -> str:
        return str(self.config.bin_dir / name)

    def _wait(
        self, what: str, ready: Callable[[], bool], proc: ManagedProcess | None = None
    ) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if proc is not None and not proc.running():
                raise ClusterError(
                    f"{proc.name} exited with status {proc.exit_code()} while waiting for {what}:\n"
                    f"{proc.tail(60)}"
                )
            if ready():
                return
            time.sleep(0.2)
        detail = f":\n{proc.tail(60)}" if proc else ""
        raise ClusterError(
            f"timed out after {self.config.startup_timeout_s}s waiting for {what}{detail}"
        )

    def _start_control_plane(self) -> None:
        pki = self._pki = LocalPKI(self.work_dir / "pki")
        self._sa = pki.service_account_keys()
        self._admin = pki.issue("admin", "dsv4-admin", org="system:masters")
        etcd_url = self._start_etcd()
        apiserver = self._start_apiserver(etcd_url)
        self.kubeconfig.write_text(
            render_kubeconfig(self.server, pki.ca.cert, self._admin, "admin")
        )
        ctx = ssl.create_default_context(cafile=str(pki.ca.cert))
        ctx.load_cert_chain(str(self._admin.cert), str(self._admin.key))
        self._wait(
            "kube-apiserver /readyz", lambda: http_ok(f"{self.server}/readyz", ctx), apiserver
        )

    def _start_etcd(self) -> str:
        """etcd, healthy; returns its client URL."""
        client_port, peer_port = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{client_port}"
        etcd = self._spawn(
            "etcd",
            [
                self._bin("etcd"),
                "--name=dsv4",
                f"--data-dir={self.work_dir / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=dsv4=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )
        self._wait("etcd", lambda: http_ok(f"{etcd_url}/health"), etcd)
        return etcd_url

    def _apiserver_certs(self) -> tuple[CertPair, CertPair]:
        """The apiserver's serving certificate and its client identity towards kubelets (logs,
        exec, port-forward)."""
        bind = self.config.bind_address
        serving = self.pki.issue(
            "apiserver",
            "kube-apiserver",
            server_hosts=[
                "127.0.0.1",
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
                "10.96.0.1",
                *([] if bind == "127.0.0.1" else [bind]),
            ],
            client=False,
        )
        kubelet_client = self.pki.issue(
            "apiserver-kubelet-client", "kube-apiserver-kubelet-client", org="system:masters"
        )
        return serving, kubelet_client

    def _start_apiserver(self, etcd_url: str) -> ManagedProcess:
        assert self._sa is not None
        ca = self.pki.ca.cert
        serving, kubelet_client = self._apiserver_certs()
        loopback = self.config.bind_address == "127.0.0.1"
        port = free_port()
        self.server = f"https://{self.config.bind_address}:{port}"
        return self._spawn(
            "kube-apiserver",
            [
                self._bin("kube-apiserver"),
                f"--etcd-servers={etcd_url}",
                f"--bind-address={self.config.bind_address}",
                f"--secure-port={port}",
                f"--cert-dir={self.work_dir / 'apiserver-certs'}",
                f"--kubelet-client-certificate={kubelet_client.cert}",
                f"--kubelet-client-key={kubelet_client.key}",
                f"--kubelet-certificate-authority={ca}",
                # nothing resolves node names here: dial the kubelet's InternalIP
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={ca}",
                # front-proxy settings the controller manager and scheduler expect to find
                f"--requestheader-client-ca-file={ca}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                "--authorization-mode=RBAC",
                f"--service-account-key-file={self._sa.cert}",
                f"--service-account-signing-key-file={self._sa.key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # The 'kubernetes' Service endpoints may not point at a loopback address.
                *(
                    ["--endpoint-reconciler-type=none"]
                    if loopback
                    else [f"--advertise-address={self.config.bind_address}"]
                ),
                "--allow-privileged=true",
                "--profiling=false",
                "--v=1",
            ],
        )

    def component_kubeconfig(self, name: str, user: str) -> Path:
        """A kubeconfig for a component (controllers, kwok; a real node's kubelet, kube-proxy,
        CoreDNS, NetworkPolicy controller) in the work dir."""
        assert self._pki is not None
        # system:masters keeps the local control plane simple; RBAC still governs every other user.
        cert = self._pki.issue(name, user, org="system:masters")
        path = self.work_dir / f"{name}.kubeconfig"
        path.write_text(render_kubeconfig(self.server, self._pki.ca.cert, cert, user))
        return path

    def _start_controller_manager(self) -> None:
        assert self._pki is not None and self._sa is not None
        kc = self.component_kubeconfig("controller-manager", "system:kube-controller-manager")
        port = free_port()
        proc = self._spawn(
            "kube-controller-manager",
            [
                self._bin("kube-controller-manager"),
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.work_dir / 'controller-manager-certs'}",
                "--leader-elect=false",
                "--use-service-account-credentials=false",
                f"--service-account-private-key-file={self._sa.key}",
                f"--root-ca-file={self._pki.ca.cert}",
                f"--cluster-signing-cert-file={self._pki.ca.cert}",
                f"--cluster-signing-key-file={self._pki.ca.key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--controllers=*",
                "--v=1",
            ],
        )
        self._wait(
            "kube-controller-manager /healthz",
            lambda: http_ok(f"https://127.0.0.1:{port}/healthz", _insecure()),
            proc,
        )

    def _start_scheduler(self) -> None:
        kc = self.component_kubeconfig("scheduler", "system:kube-scheduler")
        port = free_port()
        proc = self._spawn(
            "kube-scheduler",
            [
                self._bin("kube-scheduler"),
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.work_dir / 'scheduler-certs'}",
                "--leader-elect=false",
                "--v=1",
            ],
        )
        self._wait(
            "kube-scheduler /healthz",
            lambda: http_ok(f"https://127.0.0.1:{port}/healthz", _insecure()),
            proc,
        )

    def _start_kwok(self) -> None:
        kc = self.component_kubeconfig("kwok", "kwok-controller")
        port = free_port()
        proc = self._spawn(
            "kwok",
            [
                self._bin("kwok"),
                f"--config={KWOK_STAGES}",
                f"--kubeconfig={kc}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}={KWOK_ANNOTATION_VALUE}",
                "--cidr=10.244.0.1/16",
                "--node-ip=10.0.0.1",
                f"--server-address=127.0.0.1:{port}",
                "--node-lease-duration-seconds=40",
            ],
        )
        self._wait("kwok /healthz", lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), proc)


def _insecure() -> ssl.SSLContext:
    # Health endpoints of the controller manager and scheduler use self-signed serving certs.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def http_ok(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    """Whether ``url`` answers 200 (a health probe: any failure is False)."""
    try:
        with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False
