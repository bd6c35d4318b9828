"""A real Kubernetes control plane on 127.0.0.1 for tests and local development.

etcd, kube-apiserver and, on request, kube-controller-manager, kube-scheduler and kwok with fake
Ascend nodes, all built from Go modules by ``scripts/k8s-test-binaries``.
"""

from dsv4_operator.devcluster.cluster import ClusterConfig, LocalCluster
from dsv4_operator.devcluster.nodes import FakeNodeSpec

__all__ = ["ClusterConfig", "FakeNodeSpec", "LocalCluster"]
