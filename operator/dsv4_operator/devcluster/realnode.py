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
import fcntl
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dsv4_common.process import ManagedProcess, free_port
from dsv4_operator.devcluster import ocilayout
from dsv4_operator.devcluster.cluster import ClusterConfig, LocalCluster, _http_ok, _kubeconfig
from dsv4_operator.devcluster.hoststate import Ledger, hierarchies, revert_stale
from dsv4_operator.devcluster.node_config import (
    PAUSE_IMAGE,
    POD_NET,
    cni_config,
    containerd_config,
)
from dsv4_operator.devcluster.preflight import (
    NETPOL_BINARY,
    netpol_unavailable_reason,
    unavailable_reason,
)

NODE_BRIDGE = "dsv4-nodes"
NODE_NET = "10.98.0"
CLUSTER_DOMAIN = "cluster.local"
REAL_NODE_LABEL = "dsv4.io/real-node"
BUSYBOX_IMAGE = "dsv4.local/busybox:1"
# what every node gets at start (scripts/node-images without --app)
BASE_IMAGES = (PAUSE_IMAGE, BUSYBOX_IMAGE)
# The kubelet insists on these host sysctls; it sees them through bind mounts in its own mount
# namespace, so the host's values stay as they are.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": "1",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
}


class RealNodeError(RuntimeError):
    """A real node could not be set up; the message says what is missing or which log to read."""


def node_ip(index: int) -> str:
    return f"{NODE_NET}.{index + 1}"


@dataclass
class RealNode:
    name: str
    index: int
    ip: str
    dir: Path
    socket: Path
    root: Path
    """containerd's root (content store, snapshots, metadata): kept in the cache if it could be
    locked for this session, else a fresh one in the work dir."""
    root_reused: bool = False
    containerd: ManagedProcess | None = None
    kubelet: ManagedProcess | None = None

    @property
    def pod_subnet(self) -> str:
        return f"{POD_NET}.{self.index}.0/24"

    @property
    def cni_bridge(self) -> str:
        return f"dsv4-cni{self.index}"

    @property
    def cgroup_root(self) -> str:
        return f"dsv4-{self.name}"

    @property
    def netpol_table(self) -> str:
        """The inet nftables table of this node's NetworkPolicy controller."""
        return f"dsv4-netpol-{self.index}"


@dataclass
class RealNodes:
    """``count`` real nodes for one cluster; ``prepare()`` before the cluster starts (it binds the
    apiserver to ``api_address``), ``start(cluster)`` after, ``stop()`` after the cluster stops."""

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
    processes: list[ManagedProcess] = field(default_factory=list)
    ledger: Ledger | None = None
    netpol_reason: str | None = None
    """Why NetworkPolicies are not enforced on these nodes (None: they are)."""
    _locks: list[int] = field(default_factory=list)

    @property
    def api_address(self) -> str:
        return node_ip(0)

    @property
    def dns_ip(self) -> str:
        return node_ip(0)

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
        self._bridge(NODE_BRIDGE, [f"{node_ip(i)}/32" for i in range(self.count)])

    def start(self, cluster: LocalCluster) -> list[str]:
        """containerd + kubelet per node, kube-proxy and CoreDNS; returns the node names once
        every node is Ready."""
        assert self.ledger is not None
        pki = cluster.pki
        kubelet_kc = self._kubeconfig(cluster, "kubelet", "system:node:dsv4-real")
        for i in range(self.count):
            name = f"real-{i}"
            d = self.work_dir / name
            root, reused = self._containerd_root(name, d)
            node = RealNode(
                name, i, node_ip(i), d, d / "containerd" / "containerd.sock", root, reused
            )
            self.nodes.append(node)
            self._start_containerd(node)
            for ref in self.images:
                self._import(node, ref)
            serving = pki.issue(f"kubelet-{name}", name, server_hosts=[node.ip, name], client=False)
            self._start_kubelet(node, kubelet_kc, pki.ca.cert, serving.cert, serving.key)
        self._start_kube_proxy(cluster)
        self._start_coredns(cluster)
        self.netpol_reason = netpol_unavailable_reason(self.bin_dir)
        if self.netpol_reason is None:
            netpol_kc = self._kubeconfig(cluster, "netpol", "system:kube-network-policies")
            for node in self.nodes:
                self._start_netpol(node, netpol_kc)
        names = [n.name for n in self.nodes]
        timeout = f"{int(self.startup_timeout_s)}s"
        deadline = time.monotonic() + self.startup_timeout_s
        while not all(
            cluster.kubectl("get", "node", n, "--ignore-not-found").strip() for n in names
        ):
            self._check_alive()
            if time.monotonic() > deadline:
                raise RealNodeError(f"nodes {names} did not register:\n{self.logs()}")
            time.sleep(0.3)
        cluster.kubectl(
            "wait", "--for=condition=Ready", f"--timeout={timeout}", *(f"node/{n}" for n in names)
        )
        return names

    def stop(self) -> list[str]:
        """Pods away while the kubelets run (CNI DEL, unmounts), stop everything, then revert every
        recorded host change; returns what could not be reverted (empty when clean)."""
        for node in self.nodes:
            if node.containerd and node.containerd.running() and (self.bin_dir / "crictl").exists():
                self._crictl(node, "rmp", "-fa")
        for proc in reversed(self.processes):
            proc.stop(timeout_s=15)
        if (self.bin_dir / "kube-proxy").exists():
            subprocess.run(
                [str(self.bin_dir / "kube-proxy"), "--cleanup"], capture_output=True, timeout=60
            )
        problems = self.ledger.revert() if self.ledger else []
        self.ledger = None
        for fd in self._locks:
            os.close(fd)
        self._locks.clear()
        return problems

    def logs(self, lines: int = 30) -> str:
        return "\n".join(
            f"----- {p.name} (pid {p.pid}, exit {p.exit_code()}) {p.log_path}\n{p.tail(lines)}"
            for p in self.processes
        )

    def ctr(self, node: RealNode, *args: str, timeout: float = 600) -> str:
        res = subprocess.run(
            ["ctr", "-a", str(node.socket), "-n", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if res.returncode != 0:
            raise RealNodeError(f"ctr {' '.join(args)} on {node.name}: {res.stderr.strip()}")
        return res.stdout

    def import_image(self, ref: str) -> int:
        """Import the layout's image ``ref`` into every node's containerd, sending each node only
        the layers its content store lacks; returns the bytes of layers sent."""
        return sum(self._import(node, ref) for node in self.nodes)

    def _import(self, node: RealNode, ref: str) -> int:
        if self.layout is None:
            raise RealNodeError(f"no image layout to import {ref} from")
        img = ocilayout.image(self.layout, ref)
        have = self.ctr(node, "content", "ls", "-q").split()
        argv = ["ctr", "-a", str(node.socket), "-n", "k8s.io", "images", "import"]
        # the archive names the image by its full reference; --base-name keeps exactly that name
        argv += ["--all-platforms", "--base-name", ocilayout.repository(ref), "-"]
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        assert proc.stdin is not None and proc.stdout is not None
        layers: list[str] = []
        try:
            layers = ocilayout.thin_archive(self.layout, img, have, proc.stdin)
        except BrokenPipeError:
            pass  # ctr failed: its output says why
        finally:
            proc.stdin.close()
        out = proc.stdout.read().decode(errors="replace")
        if proc.wait(timeout=600) != 0:
            raise RealNodeError(f"importing {ref} into {node.name}: {out.strip()}")
        return sum(ocilayout.blob_path(self.layout, d).stat().st_size for d in layers)

    # ---- pieces --------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        assert self.ledger is not None
        proc = ManagedProcess(name, argv, self.work_dir / "logs" / f"{name}.log")
        proc.start()
        self.processes.append(proc)
        assert proc.pid is not None
        self.ledger.add_pid(proc.pid)
        return proc

    def _check_alive(self) -> None:
        dead = [p for p in self.processes if not p.running()]
        if dead:
            raise RealNodeError(
                f"{', '.join(p.name for p in dead)} exited:\n"
                + "\n".join(f"--- {p.name}\n{p.tail(40)}" for p in dead)
            )

    def _wait(self, what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while not ready():
            self._check_alive()
            if time.monotonic() > deadline:
                raise RealNodeError(f"timed out waiting for {what}:\n{self.logs()}")
            time.sleep(0.2)

    def _bridge(self, name: str, addresses: list[str]) -> None:
        assert self.ledger is not None
        self.ledger.add("bridges", name)
        _ip("link", "add", name, "type", "bridge")
        for addr in addresses:
            _ip("addr", "add", addr, "dev", name)
        _ip("link", "set", name, "up")

    def _kubeconfig(self, cluster: LocalCluster, name: str, user: str) -> Path:
        # system:masters: the dev apiserver runs RBAC only (no Node authorizer).
        cert = cluster.pki.issue(name, user, org="system:masters")
        path = self.work_dir / f"{name}.kubeconfig"
        path.write_text(_kubeconfig(cluster.server, cluster.pki.ca.cert, cert, user))
        return path

    def _containerd_root(self, name: str, node_dir: Path) -> tuple[Path, bool]:
        """The cached root of node ``name`` if no other session holds it (a lock held while the
        node runs, released by the kernel if this process dies), else a fresh one."""
        if self.containerd_cache is not None:
            self.containerd_cache.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.containerd_cache / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
            else:
                self._locks.append(fd)
                root = self.containerd_cache / name
                reused = (root / "io.containerd.metadata.v1.bolt").exists()
                return root, reused
        return node_dir / "containerd" / "root", False

    def _start_containerd(self, node: RealNode) -> None:
        assert self.ledger is not None
        c = node.dir / "containerd"
        cni_conf = node.dir / "cni" / "net.d"
        if not str(node.root).startswith(str(self.work_dir)):
            self.ledger.add("mount_roots", str(node.root))
        for d in (node.root, c / "state", cni_conf):
            d.mkdir(parents=True, exist_ok=True)
        (cni_conf / "10-dsv4.conflist").write_text(cni_config(node, node.dir / "cni" / "ipam"))
        (c / "config.toml").write_text(containerd_config(node, cni_conf))
        self.ledger.add("sockets", str(node.socket))
        self.ledger.add("bridges", node.cni_bridge)
        node.containerd = self._spawn(
            f"containerd-{node.name}", ["containerd", "--config", str(c / "config.toml")]
        )
        self._wait(
            f"containerd of {node.name}",
            lambda: (
                subprocess.run(
                    ["ctr", "-a", str(node.socket), "version"], capture_output=True
                ).returncode
                == 0
            ),
        )
        if node.root_reused:
            # What a session that died left in the kept root (its sandboxes and containers,
            # whose state dir is gone): removed before the kubelet could see it.
            self._crictl(node, "rmp", "-fa")
            self._crictl(node, "rm", "-fa")

    def _crictl(self, node: RealNode, *args: str) -> None:
        crictl = [str(self.bin_dir / "crictl"), "-r", f"unix://{node.socket}", "-t", "20s"]
        subprocess.run([*crictl, *args], capture_output=True, timeout=120)

    def _start_kubelet(
        self, node: RealNode, kubeconfig: Path, ca: Path, cert: Path, key: Path
    ) -> None:
        assert self.ledger is not None
        self.ledger.add("cgroup_names", node.cgroup_root)
        _make_cgroup(node.cgroup_root)
        root = node.dir / "kubelet"
        sysctl = node.dir / "sysctl"
        root.mkdir(parents=True, exist_ok=True)
        sysctl.mkdir(parents=True, exist_ok=True)
        port, healthz = free_port(), free_port()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": node.ip,
            "port": port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": healthz,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(ca)},
            },
            "authorization": {"mode": "Webhook"},
            "tlsCertFile": str(cert),
            "tlsPrivateKeyFile": str(key),
            "containerRuntimeEndpoint": f"unix://{node.socket}",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{node.cgroup_root}",
            "failCgroupV1": False,
            "failSwapOn": False,
            "protectKernelDefaults": False,
            "clusterDNS": [self.dns_ip],
            "clusterDomain": CLUSTER_DOMAIN,
            "podLogsDir": str(node.dir / "pod-logs"),
            "staticPodPath": "",
            "serializeImagePulls": False,
            # imported images must stay: nothing here could pull them again
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
            },
            "syncFrequency": "10s",
            "fileCheckFrequency": "10s",
            "nodeStatusReportFrequency": "10s",
            "enableServer": True,
        }
        cfg_path = node.dir / "kubelet-config.json"
        cfg_path.write_text(json.dumps(config, indent=1))
        binds = []
        for key_, value in KUBELET_SYSCTLS.items():
            f = sysctl / key_.replace("/", "_")
            f.write_text(value)
            binds.append(f"mount --bind {f} /proc/sys/{key_}")
        # A shared bind mount of the root dir: the volume mounts the kubelet makes there in its
        # own namespace are then seen by containerd and runc in the host's.
        self.ledger.save()
        subprocess.run(["mount", "--bind", str(root), str(root)], check=True)
        subprocess.run(["mount", "--make-shared", str(root)], check=True)
        kubelet = " ".join(
            [
                str(self.bin_dir / "kubelet"),
                f"--config={cfg_path}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={root}",
                f"--cert-dir={node.dir / 'kubelet-pki'}",
                f"--hostname-override={node.name}",
                f"--node-ip={node.ip}",
                f"--node-labels={REAL_NODE_LABEL}=true,type=real",
                "--v=1",
            ]
        )
        script = "mount --make-private /proc && " + " && ".join(binds) + f" && exec {kubelet}"
        node.kubelet = self._spawn(
            f"kubelet-{node.name}",
            ["unshare", "-m", "--propagation", "unchanged", "--", "/bin/sh", "-c", script],
        )

    def _start_kube_proxy(self, cluster: LocalCluster) -> None:
        kc = self._kubeconfig(cluster, "kube-proxy", "system:kube-proxy")
        healthz, metrics = free_port(), free_port()
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kc)},
            "mode": "iptables",
            # one kube-proxy programs the host's (the only) network namespace for every node
            "hostnameOverride": self.nodes[0].name,
            "bindAddress": self.nodes[0].ip,
            "healthzBindAddress": f"127.0.0.1:{healthz}",
            "metricsBindAddress": f"127.0.0.1:{metrics}",
            "clusterCIDR": f"{POD_NET}.0.0/16",
            "nodePortAddresses": [f"{NODE_NET}.0/24"],
            # replies of pod -> ClusterIP -> pod on one bridge must come back through the host
            "iptables": {"masqueradeAll": True, "localhostNodePorts": False, "syncPeriod": "10s"},
            # leave the host's conntrack sysctls alone
            "conntrack": {
                "maxPerCore": 0,
                "min": 0,
                "tcpEstablishedTimeout": "0s",
                "tcpCloseWaitTimeout": "0s",
            },
        }
        path = self.work_dir / "kube-proxy.json"
        path.write_text(json.dumps(config, indent=1))
        proc = self._spawn(
            "kube-proxy", [str(self.bin_dir / "kube-proxy"), f"--config={path}", "--v=1"]
        )
        self._wait(
            "kube-proxy /healthz",
            lambda: _http_ok(f"http://127.0.0.1:{healthz}/healthz") and proc.running(),
        )

    def _start_netpol(self, node: RealNode, kubeconfig: Path) -> None:
        """NetworkPolicies enforced for the node's pods: SIG Network's kube-network-policies
        (nftables in the forward path, bridged traffic included through br_netfilter; the first
        packet of each new connection to or from a pod a policy selects is decided in user
        space). One per node, each with its own table and queue, as the nodes share the host's
        network namespace."""
        assert self.ledger is not None
        table = f"inet {node.netpol_table}"
        self.ledger.add("nft_tables", table)
        self._spawn(
            f"netpol-{node.name}",
            [
                str(self.bin_dir / NETPOL_BINARY),
                f"--kubeconfig={kubeconfig}",
                f"--hostname-override={node.name}",
                f"--nfqueue-id={100 + node.index}",
                f"--nftable-name={node.netpol_table}",
                f"--metrics-bind-address=127.0.0.1:{free_port()}",
                "--v=2",
            ],
        )
        # the table appears once the controller's caches are synced and its rules are in
        self._wait(
            f"the NetworkPolicy controller of {node.name}",
            lambda: (
                subprocess.run(
                    ["nft", "list", "table", *table.split()], capture_output=True
                ).returncode
                == 0
            ),
        )

    def _start_coredns(self, cluster: LocalCluster) -> None:
        kc = self._kubeconfig(cluster, "coredns", "system:coredns")
        health, ready = free_port(), free_port()
        corefile = self.work_dir / "Corefile"
        corefile.write_text(
            f""".:53 {{
    bind {self.dns_ip}
    errors
    health 127.0.0.1:{health}
    ready 127.0.0.1:{ready}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kc} dsv4-local
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    forward . /etc/resolv.conf
    cache 5
    loadbalance
}}
"""
        )
        self._spawn("coredns", [str(self.bin_dir / "coredns"), "-conf", str(corefile)])
        self._wait("coredns /ready", lambda: _http_ok(f"http://127.0.0.1:{ready}/ready"))


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


def _make_cgroup(name: str) -> None:
    """The kubelet's cgroupRoot must exist in every hierarchy; a v1 cpuset child starts with no
    cpus or mems, so it inherits its parent's."""

    for h in hierarchies():
        d = h / name
        d.mkdir(exist_ok=True)
        for f in ("cpuset.cpus", "cpuset.mems"):
            if (h / f).exists() and not (d / f).read_text().strip():
                (d / f).write_text((h / f).read_text())


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise RealNodeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
