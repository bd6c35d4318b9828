"""Real nodes beside the kwok ones: containerd + runc + CNI bridge + kubelet per node, one
kube-proxy and one CoreDNS for the host, all joined to a ``LocalCluster``.

Needs root and the host packages of ``scripts/node-host-packages``; binaries from
``scripts/k8s-test-binaries --node``. Every host change is recorded in a ``hoststate.Ledger``
before it is made, and reverted by ``stop()`` or, after a crash, by the next ``prepare()``.

Layout (N nodes, i = 0..N-1):
- one bridge ``dsv4-nodes`` holding the node IPs 10.98.0.(i+1)/32: the kubelet refuses a
  loopback node IP, and the apiserver binds the first one so pods can reach it;
- per node a CNI bridge ``dsv4-cni<i>`` with pod subnet 10.99.i.0/24; all on one host, so pods on
  different nodes reach each other by plain routing;
- CoreDNS on 10.98.0.1:53 is the pods' cluster DNS (the kubelet's ``clusterDNS``).
"""

from __future__ import annotations

import dataclasses
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dsv4_common.process import ManagedProcess
from dsv4_devcluster.cluster import ClusterConfig, LocalCluster
from dsv4_devcluster.realnodes.containerd import Containerd
from dsv4_devcluster.realnodes.coredns import start_coredns
from dsv4_devcluster.realnodes.host import add_bridge
from dsv4_devcluster.realnodes.hoststate import Ledger, revert_stale
from dsv4_devcluster.realnodes.kube_proxy import start_kube_proxy
from dsv4_devcluster.realnodes.kubelet import start_kubelet
from dsv4_devcluster.realnodes.netpol import start_netpol
from dsv4_devcluster.realnodes.node import RealNode, RealNodeError, node_ip
from dsv4_devcluster.realnodes.node_config import PAUSE_IMAGE
from dsv4_devcluster.realnodes.preflight import netpol_unavailable_reason, unavailable_reason
from dsv4_devcluster.realnodes.supervisor import Supervisor

NODE_BRIDGE = "dsv4-nodes"
BUSYBOX_IMAGE = "dsv4.local/busybox:1"
# what every node gets at start (scripts/node-images without --app)
BASE_IMAGES = (PAUSE_IMAGE, BUSYBOX_IMAGE)


@dataclass
class RealNodes:
    """``count`` real nodes for one cluster; ``prepare()`` before the cluster starts (it binds the
    apiserver to ``api_address``), ``start(cluster)`` after, ``stop()`` after the cluster stops.
    Each piece is its own: ``Containerd`` (per node), the kubelet (per node), kube-proxy and
    CoreDNS (one each), the NetworkPolicy controllers (per node, where the kernel can)."""

    count: int
    bin_dir: Path
    work_dir: Path
    images: list[str] = field(default_factory=list)
    """References in ``layout`` imported into every node's containerd (the pause image among
    them)."""
    layout: Path | None = None
    """The OCI image layout ``scripts/node-images`` writes."""
    containerd_cache: Path | None = None
    """Where each node's containerd root is kept between sessions (``real-<i>``), so an image
    imported once (the 4.7 GB engine image) is there the next time and a new commit's image
    costs only its new layers; None: a fresh root per session in the work dir."""
    startup_timeout_s: float = 120.0
    nodes: list[RealNode] = field(default_factory=list)
    ledger: Ledger | None = None
    netpol_reason: str | None = None
    """Why NetworkPolicies are not enforced on these nodes (None: they are)."""
    _sup: Supervisor | None = None

    def __post_init__(self) -> None:
        self.containerd = Containerd(self.bin_dir, self.layout, self.containerd_cache)

    @property
    def api_address(self) -> str:
        return node_ip(0)

    @property
    def dns_ip(self) -> str:
        return node_ip(0)

    @property
    def processes(self) -> list[ManagedProcess]:
        return self._sup.processes if self._sup else []

    # ---- lifecycle ---------------------------------------------------------------------------

    def prepare(self) -> None:
        """Revert what a crashed run left, then the node-IP bridge (the apiserver binds to it)."""
        reason = unavailable_reason(self.bin_dir)
        if reason:
            raise RealNodeError(reason)
        if self.count < 1 or self.count > 200:
            raise RealNodeError(f"--real-nodes must be between 1 and 200, got {self.count}")
        left = revert_stale()
        if left:
            raise RealNodeError(
                f"a previous run left host state that could not be reverted: {left}"
            )
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.ledger = Ledger.create(self.work_dir)
        self._sup = Supervisor(self.work_dir, self.ledger, self.startup_timeout_s)
        add_bridge(self.ledger, NODE_BRIDGE, [f"{node_ip(i)}/32" for i in range(self.count)])

    def start(self, cluster: LocalCluster) -> list[str]:
        """containerd + kubelet per node, kube-proxy and CoreDNS; returns the node names once
        every node is Ready."""
        sup = self._sup
        assert sup is not None, "prepare() first"
        pki = cluster.pki
        kubelet_kc = cluster.component_kubeconfig("kubelet", "system:node:dsv4-real")
        for i in range(self.count):
            name = f"real-{i}"
            d = self.work_dir / name
            root, reused = self.containerd.root(name, d)
            node = RealNode(
                name, i, node_ip(i), d, d / "containerd" / "containerd.sock", root, reused
            )
            self.nodes.append(node)
            self.containerd.start(sup, node)
            for ref in self.images:
                self.containerd.import_image(node, ref)
            serving = pki.issue(f"kubelet-{name}", name, server_hosts=[node.ip, name], client=False)
            tls = (pki.ca.cert, serving.cert, serving.key)
            start_kubelet(sup, self.bin_dir, node, kubelet_kc, tls, self.dns_ip)
        kc = cluster.component_kubeconfig("kube-proxy", "system:kube-proxy")
        start_kube_proxy(sup, self.bin_dir, self.nodes[0], kc)
        kc = cluster.component_kubeconfig("coredns", "system:coredns")
        start_coredns(sup, self.bin_dir, self.dns_ip, kc)
        self.netpol_reason = netpol_unavailable_reason(self.bin_dir)
        if self.netpol_reason is None:
            kc = cluster.component_kubeconfig("netpol", "system:kube-network-policies")
            for node in self.nodes:
                start_netpol(sup, self.bin_dir, node, kc)
        return self._wait_ready(cluster, sup)

    def _wait_ready(self, cluster: LocalCluster, sup: Supervisor) -> list[str]:
        names = [n.name for n in self.nodes]
        deadline = time.monotonic() + self.startup_timeout_s
        while not all(
            cluster.kubectl("get", "node", n, "--ignore-not-found").strip() for n in names
        ):
            sup.check_alive()
            if time.monotonic() > deadline:
                raise RealNodeError(f"nodes {names} did not register:\n{self.logs()}")
            time.sleep(0.3)
        timeout = f"{int(self.startup_timeout_s)}s"
        cluster.kubectl(
            "wait", "--for=condition=Ready", f"--timeout={timeout}", *(f"node/{n}" for n in names)
        )
        return names

    def stop(self) -> list[str]:
        """Pods away while the kubelets run (CNI DEL, unmounts), stop everything, then revert every
        recorded host change; returns what could not be reverted (empty when clean)."""
        for node in self.nodes:
            if node.containerd and node.containerd.running() and (self.bin_dir / "crictl").exists():
                self.containerd.crictl(node, "rmp", "-fa")
        if self._sup is not None:
            self._sup.stop()
        if (self.bin_dir / "kube-proxy").exists():
            subprocess.run(
                [str(self.bin_dir / "kube-proxy"), "--cleanup"], capture_output=True, timeout=60
            )
        problems = self.ledger.revert() if self.ledger else []
        self.ledger = None
        self.containerd.release()
        return problems

    def logs(self, lines: int = 30) -> str:
        return self._sup.logs(lines) if self._sup else ""

    def ctr(self, node: RealNode, *args: str, timeout: float = 600) -> str:
        return self.containerd.ctr(node, *args, timeout=timeout)

    def import_image(self, ref: str) -> int:
        """Import the layout's image ``ref`` into every node's containerd, sending each node only
        the layers its content store lacks; returns the bytes of layers sent."""
        return sum(self.containerd.import_image(node, ref) for node in self.nodes)


@contextmanager
def cluster_with_real_nodes(
    config: ClusterConfig, real: RealNodes, fake_nodes: int = 1
) -> Iterator[LocalCluster]:
    """A ``LocalCluster`` with ``fake_nodes`` kwok nodes and ``real.count`` real ones; on exit the
    real nodes stop first and every host change is reverted (a failure to revert raises)."""
    real.prepare()
    cluster = LocalCluster(dataclasses.replace(config, bind_address=real.api_address))
    problems: list[str] = []
    try:
        cluster.start()
        cluster.start_workloads(fake_nodes)
        real.start(cluster)
        yield cluster
    finally:
        try:
            problems = real.stop()
        finally:
            cluster.stop()
    if problems:
        raise RealNodeError(f"host state left after stopping the real nodes: {problems}")
