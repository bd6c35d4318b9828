"""One real node's record: its names, addresses and paths, which every real-node piece reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dsv4_common.process import ManagedProcess

NODE_NET = "10.98.0"
"""The node IPs 10.98.0.(i+1)/32 (on one bridge): the kubelet refuses a loopback node IP."""
POD_NET = "10.99"
"""Node i's pods get 10.99.i.0/24 on its own CNI bridge."""


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
