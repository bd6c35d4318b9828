"""NetworkPolicies enforced for a real node's pods: SIG Network's kube-network-policies
(nftables in the forward path, bridged traffic included through br_netfilter; the first packet
of each new connection to or from a pod a policy selects is decided in user space). One per
node, each with its own table and queue, as the nodes share the host's network namespace."""

from __future__ import annotations

import subprocess
from pathlib import Path

from dsv4_common.process import free_port
from dsv4_devcluster.realnodes.node import RealNode
from dsv4_devcluster.realnodes.preflight import NETPOL_BINARY
from dsv4_devcluster.realnodes.supervisor import Supervisor


def start_netpol(sup: Supervisor, bin_dir: Path, node: RealNode, kubeconfig: Path) -> None:
    """The NetworkPolicy controller of ``node`` (its rules in place before this returns)."""
    table = f"inet {node.netpol_table}"
    sup.ledger.add("nft_tables", table)
    sup.spawn(
        f"netpol-{node.name}",
        [
            str(bin_dir / NETPOL_BINARY),
            f"--kubeconfig={kubeconfig}",
            f"--hostname-override={node.name}",
            f"--nfqueue-id={100 + node.index}",
            f"--nftable-name={node.netpol_table}",
            f"--metrics-bind-address=127.0.0.1:{free_port()}",
            "--v=2",
        ],
    )
    # the table appears once the controller's caches are synced and its rules are in
    sup.wait(
        f"the NetworkPolicy controller of {node.name}",
        lambda: (
            subprocess.run(["nft", "list", "table", *table.split()], capture_output=True).returncode
            == 0
        ),
    )
