"""Each real node's kubelet: its configuration, its cgroup root, and a mount namespace of its
own in which the host sysctls it insists on read as it wants them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from dsv4_common.process import free_port
from dsv4_devcluster.realnodes.host import make_cgroup
from dsv4_devcluster.realnodes.node import RealNode
from dsv4_devcluster.realnodes.supervisor import Supervisor

CLUSTER_DOMAIN = "cluster.local"
REAL_NODE_LABEL = "dsv4.io/real-node"
# The kubelet insists on these host sysctls; it sees them through bind mounts in its own mount
# namespace, so the host's values stay as they are.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": "1",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
}


def kubelet_config(
    node: RealNode, ca: Path, cert: Path, key: Path, dns_ip: str, port: int, healthz: int
) -> dict[str, Any]:
    """The KubeletConfiguration of ``node``: webhook authn/z against the cluster, cgroupfs under
    the node's cgroup root, the host's CoreDNS as cluster DNS, no image GC."""
    return {
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
        "clusterDNS": [dns_ip],
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


def start_kubelet(
    sup: Supervisor,
    bin_dir: Path,
    node: RealNode,
    kubeconfig: Path,
    tls: tuple[Path, Path, Path],
    dns_ip: str,
) -> None:
    """The kubelet of ``node``; ``tls``: the cluster CA, the kubelet's serving cert and key."""
    make_cgroup(sup.ledger, node.cgroup_root)
    root = node.dir / "kubelet"
    root.mkdir(parents=True, exist_ok=True)
    ca, cert, key = tls
    config = kubelet_config(node, ca, cert, key, dns_ip, free_port(), free_port())
    cfg_path = node.dir / "kubelet-config.json"
    cfg_path.write_text(json.dumps(config, indent=1))
    # A shared bind mount of the root dir: the volume mounts the kubelet makes there in its
    # own namespace are then seen by containerd and runc in the host's.
    sup.ledger.save()
    subprocess.run(["mount", "--bind", str(root), str(root)], check=True)
    subprocess.run(["mount", "--make-shared", str(root)], check=True)
    kubelet = " ".join(
        [
            str(bin_dir / "kubelet"),
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
    binds = _sysctl_binds(node.dir / "sysctl")
    script = "mount --make-private /proc && " + " && ".join(binds) + f" && exec {kubelet}"
    node.kubelet = sup.spawn(
        f"kubelet-{node.name}",
        ["unshare", "-m", "--propagation", "unchanged", "--", "/bin/sh", "-c", script],
    )


def _sysctl_binds(sysctl: Path) -> list[str]:
    """Files holding ``KUBELET_SYSCTLS``' values, and the bind mounts over /proc/sys for them."""
    sysctl.mkdir(parents=True, exist_ok=True)
    binds = []
    for name, value in KUBELET_SYSCTLS.items():
        f = sysctl / name.replace("/", "_")
        f.write_text(value)
        binds.append(f"mount --bind {f} /proc/sys/{name}")
    return binds
