"""A real node runs real processes: pods get IPs from the CNI bridge, probes, logs and exec go
through the kubelet, Services work through kube-proxy and names through CoreDNS."""

from __future__ import annotations

import time
from typing import Any

from tests.node.conftest import apply, busybox_pod, wait_pod


def test_real_node_is_ready_and_labelled_beside_the_fake_one(real_cluster: Any) -> None:
    real = real_cluster.kubectl("get", "nodes", "-l", "dsv4.io/real-node=true", "-o", "name")
    fake = real_cluster.kubectl("get", "nodes", "-l", "type=kwok", "-o", "name")
    assert real.split() == ["node/real-0"]
    assert fake.split() == ["node/ascend-node-0"]
    runtime = real_cluster.kubectl(
        "get", "node", "real-0", "-o", "jsonpath={.status.nodeInfo.containerRuntimeVersion}"
    )
    assert runtime.startswith("containerd://")


def test_pod_runs_a_process_with_logs_and_exec(real_cluster: Any, real_namespace: str) -> None:
    ns = real_namespace
    pod = busybox_pod("hello", "echo started; exec sleep 3600")
    pod["metadata"]["namespace"] = ns
    apply(real_cluster, pod)
    wait_pod(real_cluster, ns, "hello")
    assert real_cluster.kubectl("logs", "-n", ns, "hello").strip() == "started"
    out = real_cluster.kubectl(
        "exec", "-n", ns, "hello", "--", "sh", "-c", "echo $((6*7)); cat /proc/1/cmdline"
    )
    assert out.splitlines()[0] == "42"
    ip = real_cluster.kubectl("get", "pod", "-n", ns, "hello", "-o", "jsonpath={.status.podIP}")
    assert ip.startswith("10.99.0."), ip


def _http_get(cluster: Any, ns: str, pod: str, host: str, port: int, path: str) -> str:
    # busybox's nc: Debian's static busybox wget crashes in this image
    script = f'printf "GET {path} HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n" | nc -w 3 {host} {port}'
    return str(cluster.kubectl("exec", "-n", ns, pod, "--", "sh", "-c", script, check=False))


def test_service_and_dns_from_a_pod(real_cluster: Any, real_namespace: str) -> None:
    """ClusterIP through kube-proxy, a name through CoreDNS, the API's Service from a pod."""
    ns = real_namespace
    web = busybox_pod(
        "web",
        "mkdir -p /www && echo hello-from-web > /www/index.html && exec httpd -f -p 8080 -h /www",
    )
    web["spec"]["containers"][0]["readinessProbe"] = {
        "httpGet": {"path": "/index.html", "port": 8080},
        "periodSeconds": 1,
    }
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    client = busybox_pod("client", "exec sleep 3600")
    for obj in (web, svc, client):
        obj["metadata"]["namespace"] = ns
    apply(real_cluster, web, svc, client)
    wait_pod(real_cluster, ns, "web")
    wait_pod(real_cluster, ns, "client")
    # kube-proxy programs a new Service within its sync period
    deadline = time.monotonic() + 30
    while "hello-from-web" not in (
        got := _http_get(real_cluster, ns, "client", "web", 80, "/index.html")
    ):
        assert time.monotonic() < deadline, got
        time.sleep(1)
    fqdn = f"web.{ns}.svc.cluster.local"
    assert "hello-from-web" in _http_get(real_cluster, ns, "client", fqdn, 80, "/index.html")
    # the apiserver's Service (10.96.0.1:443 -> the advertised address) reaches the apiserver
    got = _http_get(real_cluster, ns, "client", "kubernetes.default.svc", 443, "/version")
    assert "Client sent an HTTP request to an HTTPS server" in got, got
