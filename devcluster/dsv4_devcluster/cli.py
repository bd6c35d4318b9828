"""``dsv4 dev-cluster``: a local control plane with fake Ascend nodes, until Ctrl-C."""

from __future__ import annotations

import argparse
import contextlib
import signal
import tempfile
import threading
from pathlib import Path

from dsv4_devcluster.binaries import cache_root, ensure_binaries, ensure_node_images
from dsv4_devcluster.cluster import ClusterConfig, LocalCluster
from dsv4_devcluster.kwok_nodes import FakeNodeSpec
from dsv4_devcluster.realnodes.nodes import (
    BASE_IMAGES,
    RealNodes,
    cluster_with_real_nodes,
)
from dsv4_devcluster.realnodes.preflight import unavailable_reason


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=2, help="fake Ascend nodes to register (default 2)")
    p.add_argument("--npus-per-node", type=int, default=8, help="NPUs each fake node advertises")
    p.add_argument(
        "--npu-resource", default="huawei.com/Ascend910", help="extended resource name of the NPUs"
    )
    p.add_argument(
        "--work-dir", type=Path, default=None, help="state, certs and logs (default: temp)"
    )
    p.add_argument(
        "--real-nodes",
        type=int,
        default=0,
        help="real nodes (containerd + kubelet, labelled dsv4.io/real-node=true) beside the fake "
        "ones; needs root and scripts/node-host-packages (default 0)",
    )
    p.add_argument(
        "--control-plane-only",
        action="store_true",
        help="etcd and kube-apiserver only: no controllers, scheduler or nodes",
    )


def run(args: argparse.Namespace) -> int:
    if args.nodes < 0:
        raise SystemExit("dsv4 dev-cluster: error: --nodes must be >= 0")
    if args.npus_per_node < 0:
        raise SystemExit("dsv4 dev-cluster: error: --npus-per-node must be >= 0")
    if args.real_nodes < 0:
        raise SystemExit("dsv4 dev-cluster: error: --real-nodes must be >= 0")
    if args.real_nodes and args.control_plane_only:
        raise SystemExit(
            "dsv4 dev-cluster: error: --real-nodes needs the workloads, not --control-plane-only"
        )
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="dsv4-dev-cluster-"))
    spec = FakeNodeSpec(npu_resource=args.npu_resource, npus=args.npus_per_node)
    bin_dir = ensure_binaries(node=args.real_nodes > 0)
    config = ClusterConfig(bin_dir=bin_dir, work_dir=work, node_spec=spec)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.ExitStack() as stack:
        if args.real_nodes:
            reason = unavailable_reason(bin_dir)
            if reason:
                raise SystemExit(f"dsv4 dev-cluster: error: --real-nodes: {reason}")
            real = RealNodes(
                args.real_nodes,
                bin_dir,
                work / "real-nodes",
                images=list(BASE_IMAGES),
                layout=ensure_node_images(),
                containerd_cache=cache_root() / "containerd",
            )
            cluster = stack.enter_context(cluster_with_real_nodes(config, real, args.nodes))
        else:
            cluster = stack.enter_context(LocalCluster(config))
            if not args.control_plane_only:
                cluster.start_workloads(args.nodes)
        print(f"API server: {cluster.server}")
        print(f"export KUBECONFIG={cluster.kubeconfig}")
        print(f"logs: {cluster.log_dir}")
        print("Ctrl-C stops the cluster.", flush=True)
        try:
            while not stop.wait(1.0):
                procs = cluster.processes + (real.processes if args.real_nodes else [])
                dead = [p.name for p in procs if not p.running()]
                if dead:
                    print(f"components exited: {', '.join(dead)}\n{cluster.logs()}")
                    return 1
        except KeyboardInterrupt:
            pass
    return 0
