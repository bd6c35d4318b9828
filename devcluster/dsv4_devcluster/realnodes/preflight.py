"""Whether this host can run real nodes (and enforce NetworkPolicies), and if not, why."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CNI_BIN_DIR = Path("/usr/lib/cni")  # the CNI plugins scripts/node-host-packages installs
NODE_BINARIES = ("kubelet", "kube-proxy", "crictl", "coredns")
NETPOL_BINARY = "kube-network-policies"  # built only where the kernel can run it
HOST_TOOLS = ("containerd", "ctr", "runc", "iptables", "nft", "ip", "unshare", "mount")


def unavailable_reason(bin_dir: Path) -> str | None:
    """Why real nodes cannot run on this host, or None when they can."""
    if os.geteuid() != 0:
        return "real nodes need root (containerd, runc, bridges, iptables, cgroups)"
    missing = [t for t in HOST_TOOLS if shutil.which(t) is None]
    if not (CNI_BIN_DIR / "bridge").exists():
        missing.append(f"{CNI_BIN_DIR}/bridge")
    if missing:
        return f"missing host tools {', '.join(missing)}: run scripts/node-host-packages"
    bins = [b for b in NODE_BINARIES if not (bin_dir / b).exists()]
    if bins:
        return f"{bin_dir} lacks {', '.join(bins)}: run scripts/k8s-test-binaries --node"
    return None


# kube-network-policies hands new connections to user space with nftables' queue expression;
# `nft -c` checks a table using it against the kernel without creating anything.
_NFT_QUEUE_PROBE = """table inet dsv4-probe {
 chain c {
  type filter hook postrouting priority 95;
  queue num 100
 }
}
"""


def netpol_unavailable_reason(bin_dir: Path) -> str | None:
    """Why NetworkPolicies cannot be enforced on this host, or None when they can."""
    res = subprocess.run(
        ["nft", "-c", "-f", "-"], input=_NFT_QUEUE_PROBE, capture_output=True, text=True
    )
    if res.returncode != 0:
        return (
            "this kernel's nftables has no queue expression (nft_queue; `nft -c` of a queue "
            "rule: No such file or directory), which kube-network-policies needs to decide "
            "new connections: NetworkPolicies are not enforced here"
        )
    bridge_nf = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
    if not bridge_nf.exists() or bridge_nf.read_text().strip() != "1":
        return "bridged pod traffic bypasses netfilter (br_netfilter off): policies not enforced"
    if not (bin_dir / NETPOL_BINARY).exists():
        return f"{bin_dir} lacks {NETPOL_BINARY}: run scripts/k8s-test-binaries --node"
    return None
