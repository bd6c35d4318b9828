"""Real nodes beside the kwok ones (containerd, runc, CNI bridges, kubelet, kube-proxy, CoreDNS,
NetworkPolicies): ``nodes.RealNodes`` composes the pieces, each module runs one of them."""
