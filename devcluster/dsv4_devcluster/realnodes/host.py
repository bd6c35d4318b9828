"""The host's kernel objects real nodes need: bridges (node IPs, each node's pods) and the
kubelet's cgroup root; each recorded in the ledger before it is made."""

from __future__ import annotations

import subprocess

from dsv4_devcluster.realnodes.hoststate import Ledger, hierarchies
from dsv4_devcluster.realnodes.node import RealNodeError


def add_bridge(ledger: Ledger, name: str, addresses: list[str]) -> None:
    ledger.add("bridges", name)
    _ip("link", "add", name, "type", "bridge")
    for addr in addresses:
        _ip("addr", "add", addr, "dev", name)
    _ip("link", "set", name, "up")


def make_cgroup(ledger: Ledger, name: str) -> None:
    """The kubelet's cgroupRoot must exist in every hierarchy; a v1 cpuset child starts with no
    cpus or mems, so it inherits its parent's."""
    ledger.add("cgroup_names", name)
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
