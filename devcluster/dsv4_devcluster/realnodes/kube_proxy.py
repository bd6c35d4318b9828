"""One kube-proxy for every real node: the nodes share the host's network namespace, so one
programs the Services' iptables rules for all of them."""

from __future__ import annotations

import json
from pathlib import Path

from dsv4_common.process import free_port
from dsv4_devcluster.cluster import http_ok
from dsv4_devcluster.realnodes.node import NODE_NET, POD_NET, RealNode
from dsv4_devcluster.realnodes.supervisor import Supervisor


def start_kube_proxy(sup: Supervisor, bin_dir: Path, first: RealNode, kubeconfig: Path) -> None:
    """kube-proxy as node ``first`` (healthy before this returns)."""
    healthz, metrics = free_port(), free_port()
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "mode": "iptables",
        # one kube-proxy programs the host's (the only) network namespace for every node
        "hostnameOverride": first.name,
        "bindAddress": first.ip,
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
    path = sup.work_dir / "kube-proxy.json"
    path.write_text(json.dumps(config, indent=1))
    proc = sup.spawn("kube-proxy", [str(bin_dir / "kube-proxy"), f"--config={path}", "--v=1"])
    sup.wait(
        "kube-proxy /healthz",
        lambda: http_ok(f"http://127.0.0.1:{healthz}/healthz") and proc.running(),
    )
