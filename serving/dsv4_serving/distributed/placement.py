"""Where one ``dsv4 engine`` process's ranks sit in a (possibly multi-node) instance.

Every node of an instance runs the same command; the node's rank, the node count and the
leader's address come from the environment the operator renders (``reconcile/identity.py``:
``DSV4_NODE_RANK``, ``DSV4_NODES_PER_INSTANCE``, ``DSV4_MASTER_ADDR``), or from flags that win
over it. Node 0 serves the API and hosts the rendezvous; node ``n > 0`` runs its ranks headless.
Pure Python (no torch): the CLI validates it before anything starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from dsv4_serving.distributed.topology import Topology

NODE_RANK_ENV = "DSV4_NODE_RANK"
NNODES_ENV = "DSV4_NODES_PER_INSTANCE"
MASTER_ADDR_ENV = "DSV4_MASTER_ADDR"
MASTER_PORT_ENV = "DSV4_MASTER_PORT"
# the rendezvous port on node 0 when the instance spans nodes (a free local port otherwise)
DEFAULT_MASTER_PORT = 29550


class PlacementError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Placement:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free local port (one node only)

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise PlacementError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise PlacementError(
                f"--node-rank {self.node_rank} is outside the instance's {self.nnodes} node(s)"
            )
        if not 0 <= self.master_port < 65536:
            raise PlacementError(f"--master-port must be in [0, 65535], got {self.master_port}")
        if self.nnodes > 1 and not self.master_port:
            raise PlacementError("a multi-node instance needs --master-port (node 0's port)")

    @property
    def headless(self) -> bool:
        """Ranks only: no API server (every node but node 0)."""
        return self.node_rank > 0

    def ranks(self, topo: Topology) -> list[int]:
        """This node's global ranks (``topo`` with this placement's node count)."""
        return topo.node_ranks(self.node_rank)

    @classmethod
    def resolve(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        nnodes: int | None = None,
        node_rank: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
    ) -> Placement:
        """Flags (non-None) over the operator's environment over the one-node defaults."""
        env = os.environ if env is None else env

        def num(value: int | None, name: str, default: int) -> int:
            if value is not None:
                return value
            raw = env.get(name, "")
            if not raw:
                return default
            try:
                return int(raw)
            except ValueError:
                raise PlacementError(f"{name}={raw!r} is not an integer") from None

        n = num(nnodes, NNODES_ENV, 1)
        # A one-node instance's ranks are all in this pod: the operator's leader name (the pod's
        # own DNS name) does not resolve before the pod is Ready (its Service publishes
        # not-ready addresses only for multi-node instances), so the env's address is not used.
        env_addr = env.get(MASTER_ADDR_ENV) if n > 1 else None
        return cls(
            nnodes=n,
            node_rank=num(node_rank, NODE_RANK_ENV, 0),
            master_addr=master_addr or env_addr or "127.0.0.1",
            master_port=num(master_port, MASTER_PORT_ENV, DEFAULT_MASTER_PORT if n > 1 else 0),
        )
