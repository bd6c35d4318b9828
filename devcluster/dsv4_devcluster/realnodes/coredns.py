"""CoreDNS on the first node's IP: the pods' cluster DNS (every kubelet's ``clusterDNS``)."""

from __future__ import annotations

from pathlib import Path

from dsv4_common.process import free_port
from dsv4_devcluster.cluster import http_ok
from dsv4_devcluster.realnodes.kubelet import CLUSTER_DOMAIN
from dsv4_devcluster.realnodes.supervisor import Supervisor


def start_coredns(sup: Supervisor, bin_dir: Path, dns_ip: str, kubeconfig: Path) -> None:
    """CoreDNS serving the cluster's names on ``dns_ip``:53 (ready before this returns)."""
    health, ready = free_port(), free_port()
    corefile = sup.work_dir / "Corefile"
    corefile.write_text(
        f""".:53 {{
    bind {dns_ip}
    errors
    health 127.0.0.1:{health}
    ready 127.0.0.1:{ready}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} dsv4-local
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
    sup.spawn("coredns", [str(bin_dir / "coredns"), "-conf", str(corefile)])
    sup.wait("coredns /ready", lambda: http_ok(f"http://127.0.0.1:{ready}/ready"))
