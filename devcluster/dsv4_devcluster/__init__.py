"""The dev cluster: a real Kubernetes control plane on 127.0.0.1 for tests, benchmarks and local
development (``dsv4 dev-cluster``), and what runs around it.

- ``cluster``: etcd, kube-apiserver and, on request, kube-controller-manager, kube-scheduler and
  kwok, all built from Go modules by ``scripts/k8s-test-binaries``;
- three kinds of node: ``kwok_nodes`` (fake Ascend servers), ``realnodes`` (containerd + kubelet
  on this host, root) and ``process_nodes`` (real engines behind kwok pods);
- ``operator_process`` (``dsv4 operator`` as a child), ``jaeger`` (the trace backend) and
  ``vllm_router`` (the gateway's point of comparison).

Nothing in the operator, the serving stack or kvtransfer imports it; it imports them.
"""

from dsv4_devcluster.cluster import ClusterConfig, LocalCluster
from dsv4_devcluster.kwok_nodes import FakeNodeSpec

__all__ = ["ClusterConfig", "FakeNodeSpec", "LocalCluster"]
