"""The shipped tiny example on real pods: the Helm chart's operator (its own image, in a pod)
renders engine, sidecar and gateway pods that really start; a completion through the gateway's
Service goes prefill -> KV over TCP between pods -> decode."""

from __future__ import annotations

import copy
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsv4_common.process import metric_value
from tests.node.conftest import (
    REAL_NODE_SELECTOR,
    RealClusterHandle,
    apply,
    busybox_pod,
    deployment,
    wait_pod,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "manifests" / "examples" / "tiny-cpu.yaml"
NS = "dsv4-e2e"


def gateway_url(cluster: Any, ns: str, name: str) -> str:
    svc = json.loads(cluster.kubectl("get", "svc", f"{name}-gateway", "-n", ns, "-o", "json"))
    return f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}/v1"


def greedy_completion(url: str) -> Any:
    """16 greedy tokens (random tiny weights may emit EOS at once: EOS is ignored)."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", timeout=120, max_retries=0)
    deadline = time.monotonic() + 60
    while True:  # kube-proxy syncs the new Service within its period
        try:
            return client.completions.create(
                model="dsv4-tiny",
                prompt="hello from a real pod",
                max_tokens=16,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def tiny_on_real_node(images: dict[str, str], ns: str = NS) -> dict[str, Any]:
    """manifests/examples/tiny-cpu.yaml as shipped, pointed at the locally built images and the
    real node, with requests that fit a 2-CPU machine."""
    cr: dict[str, Any] = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    spec = cr["spec"]
    cr["metadata"]["namespace"] = ns
    spec["engine"] = {**spec.get("engine", {}), "image": images["engine"]}
    spec["gateway"]["image"] = images["operator"]
    spec.setdefault("scheduling", {})["nodeSelector"] = dict(REAL_NODE_SELECTOR)
    for role in ("prefill", "decode"):
        spec[role]["resources"] = {"requests": {"cpu": "100m", "memory": "512Mi"}}
    spec["kvTransfer"]["sidecarResources"] = {"requests": {"cpu": "50m", "memory": "256Mi"}}
    return cr


@pytest.fixture(scope="module")
def tiny(
    real_cluster: Any,
    real_handle: RealClusterHandle,
    app_images: dict[str, str],
    chart_operator: None,
) -> Any:
    t0 = time.monotonic()
    with deployment(real_cluster, tiny_on_real_node(app_images)):
        real_handle.timings["tiny Ready after apply"] = time.monotonic() - t0
        yield real_cluster


def _gateway_url(cluster: Any) -> str:
    return gateway_url(cluster, NS, "tiny")


def _kv_bytes(cluster: Any, role: str, direction: str) -> float:
    """dsv4_kv_transfer_bytes_total{direction} summed over the role's sidecars (via pod IPs)."""
    pods = json.loads(
        cluster.kubectl("get", "pods", "-n", NS, "-l", f"serving.dsv4.io/role={role}", "-o", "json")
    )["items"]
    total = 0.0
    for pod in pods:
        port = next(
            p["containerPort"]
            for c in pod["spec"]["containers"]
            for p in c.get("ports", [])
            if p.get("name") == "kv-metrics"
        )
        url = f"http://{pod['status']['podIP']}:{port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            total += metric_value(
                resp.read().decode(), "dsv4_kv_transfer_bytes_total", direction=direction
            )
    return total


def test_completion_through_the_gateway_service_moves_kv_between_pods(
    tiny: Any, real_handle: RealClusterHandle
) -> None:
    out = greedy_completion(_gateway_url(tiny))
    assert out.usage is not None and out.usage.completion_tokens == 16
    received = _kv_bytes(tiny, "decode", "received")
    assert received > 0
    assert _kv_bytes(tiny, "prefill", "sent") == received
    # the oracle of the 2-node instance (test_operator_two_node.py): the same greedy tokens
    real_handle.notes["tiny greedy text"] = [out.choices[0].text]


def _exec(cluster: Any, pod: str, container: str, script: str) -> str:
    return str(cluster.kubectl("exec", "-n", NS, pod, "-c", container, "--", "sh", "-c", script))


def test_engine_pods_run_as_rendered(tiny: Any) -> None:
    """Security context, shm sizing and probes of the rendered pod, as the kernel sees them."""
    pods = json.loads(
        tiny.kubectl("get", "pods", "-n", NS, "-l", "serving.dsv4.io/role=decode", "-o", "json")
    )["items"]
    pod = pods[0]
    name = pod["metadata"]["name"]
    containers = [c["name"] for c in pod["spec"]["containers"]]
    shm_limit = next(
        v["emptyDir"]["sizeLimit"] for v in pod["spec"]["volumes"] if v["name"] == "shm"
    )
    assert shm_limit == "1Gi"  # the shipped example's shmSize
    for c in containers:
        # uid 1000, no capabilities (CapEff all zero), /dev/shm a tmpfs of exactly shmSize
        out = _exec(
            tiny,
            name,
            c,
            "id -u; grep CapEff /proc/self/status; df -k /dev/shm | tail -1; "
            "grep ' /dev/shm ' /proc/mounts",
        ).splitlines()
        assert out[0] == "1000", (c, out)
        assert out[1].split()[1] == "0000000000000000", (c, out)
        assert out[2].split()[1] == str(1 << 20), (c, out)  # KiB
        assert out[3].split()[2] == "tmpfs", (c, out)
    # every container passed its probes: Ready, no restarts
    statuses = pod["status"]["containerStatuses"]
    assert all(s["ready"] and s["restartCount"] == 0 for s in statuses), [
        (s["name"], s["ready"], s["restartCount"], s.get("lastState")) for s in statuses
    ]
    policies = tiny.kubectl("get", "networkpolicy", "-n", NS, "-o", "name").split()
    assert sorted(policies) == [
        "networkpolicy.networking.k8s.io/tiny-engines",
        "networkpolicy.networking.k8s.io/tiny-gateway",
    ]


def _pod(cluster: Any, selector: str) -> dict[str, Any]:
    pods = json.loads(cluster.kubectl("get", "pods", "-n", NS, "-l", selector, "-o", "json"))
    return dict(pods["items"][0])


def _port(pod: dict[str, Any], name: str) -> int:
    return next(
        int(p["containerPort"])
        for c in pod["spec"]["containers"]
        for p in c.get("ports", [])
        if p.get("name") == name
    )


def _connects(cluster: Any, pod: str, container: str, ip: str, port: int) -> str:
    """'ok', or why a TCP connect from the pod failed ('timeout': the SYN was dropped)."""
    script = (
        "import socket, sys\n"
        "try:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()"
        "; print('ok')\n"
        "except socket.timeout: print('timeout')\n"
        "except OSError as e: print(type(e).__name__)"
    )
    argv = ["exec", "-n", NS, pod, "-c", container, "--", "python", "-c", script, ip, str(port)]
    return str(cluster.kubectl(*argv)).strip()


def _busybox_connects(cluster: Any, pod: str, ip: str, port: int) -> str:
    out = cluster.kubectl(
        "exec",
        "-n",
        NS,
        pod,
        "--",
        "sh",
        "-c",
        f"nc -w 3 {ip} {port} </dev/null >/dev/null 2>/tmp/err && echo ok || cat /tmp/err",
        check=False,
    )
    return "ok" if str(out).strip() == "ok" else "timeout" if "timed out" in str(out) else str(out)


def test_network_policies_are_enforced_as_rendered(
    tiny: Any, real_handle: RealClusterHandle
) -> None:
    """The rendered NetworkPolicies, enforced by SIG Network's kube-network-policies on the real
    node: a pod that is none of the deployment's cannot open a connection to an engine's HTTP
    port or a sidecar's KV port (its SYN is dropped), while it reaches the gateway (open to every
    client), the gateway reaches the engine and one engine pod the other's KV port. An extra
    policy that admits the outsider opens the engine port to it: the policies decide, not a
    broken network."""
    if real_handle.real.netpol_reason:
        pytest.skip(real_handle.real.netpol_reason)
    decode = _pod(tiny, "serving.dsv4.io/role=decode")
    prefill = _pod(tiny, "serving.dsv4.io/role=prefill")
    gateway = _pod(tiny, "serving.dsv4.io/role=gateway")
    decode_ip, gateway_ip = decode["status"]["podIP"], gateway["status"]["podIP"]
    engine_port, kv_port = _port(decode, "http"), _port(decode, "kv")
    apply(
        tiny,
        {
            **busybox_pod("outsider", "exec sleep 3600"),
            "metadata": {"name": "outsider", "namespace": NS, "labels": {"app": "outsider"}},
        },
    )
    try:
        wait_pod(tiny, NS, "outsider")
        outsider = lambda ip, port: _busybox_connects(tiny, "outsider", ip, port)  # noqa: E731
        assert outsider(gateway_ip, _port(gateway, "http")) == "ok"
        assert outsider(decode_ip, engine_port) == "timeout"
        assert outsider(decode_ip, kv_port) == "timeout"
        assert outsider(prefill["status"]["podIP"], engine_port) == "timeout"
        gw = gateway["metadata"]["name"]
        assert (
            _connects(tiny, gw, gateway["spec"]["containers"][0]["name"], decode_ip, engine_port)
            == "ok"
        )
        pf = prefill["metadata"]["name"]
        assert _connects(tiny, pf, "engine", decode_ip, kv_port) == "ok"
        admit = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "admit-outsider", "namespace": NS},
            "spec": {
                "podSelector": {"matchLabels": {"serving.dsv4.io/role": "decode"}},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": [{"podSelector": {"matchLabels": {"app": "outsider"}}}],
                        "ports": [{"protocol": "TCP", "port": engine_port}],
                    }
                ],
            },
        }
        apply(tiny, admit)
        deadline = time.monotonic() + 30
        while (seen := outsider(decode_ip, engine_port)) != "ok":
            assert time.monotonic() < deadline, f"admitted outsider still cannot connect: {seen}"
            time.sleep(1)
        assert outsider(decode_ip, kv_port) == "timeout"  # admitted to the engine port only
    finally:
        tiny.kubectl(
            "delete", "networkpolicy", "-n", NS, "admit-outsider", "--ignore-not-found", check=False
        )
        tiny.kubectl("delete", "pod", "-n", NS, "outsider", "--wait=false", check=False)


def _pod_uid(cluster: Any, role: str) -> tuple[str, str, bool]:
    """The role's pod: name, uid, Ready; ("", "", False) between a deleted pod and its
    replacement (the StatefulSet creates it once the old one is gone)."""
    items = json.loads(
        cluster.kubectl("get", "pods", "-n", NS, "-l", f"serving.dsv4.io/role={role}", "-o", "json")
    )["items"]
    if not items:
        return "", "", False
    pod = items[0]
    ready = any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", [])
    )
    return pod["metadata"]["name"], pod["metadata"]["uid"], ready


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_deleting_an_engine_pod_while_requests_stream(
    tiny: Any, real_handle: RealClusterHandle, role: str
) -> None:
    """Stream completions through the gateway's Service while one engine pod is deleted: every
    request ends (none hangs), failures are OpenAI-style errors, and service comes back once
    the StatefulSet's replacement is Ready. What a user saw is recorded in the tier's report."""
    import threading

    from openai import APIStatusError, OpenAI

    client = OpenAI(base_url=_gateway_url(tiny), api_key="unused", timeout=60, max_retries=0)
    results: list[tuple[float, float, str]] = []
    stop = threading.Event()

    def user() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                stream = client.completions.create(
                    model="dsv4-tiny",
                    prompt="a user streaming",
                    max_tokens=24,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                chunks = sum(1 for _ in stream)
                results.append((t0, time.monotonic(), "ok" if chunks else "empty"))
            except APIStatusError as e:
                results.append((t0, time.monotonic(), f"HTTP {e.status_code}"))
                time.sleep(0.2)
            except Exception as e:  # a connection reset is what a user can see too
                results.append((t0, time.monotonic(), type(e).__name__))
                time.sleep(0.2)

    thread = threading.Thread(target=user, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while sum(r[2] == "ok" for r in results) < 2:
            assert time.monotonic() < deadline, results
            time.sleep(0.2)
        name, uid, _ = _pod_uid(tiny, role)
        t_delete = time.monotonic()
        tiny.kubectl("delete", "pod", "-n", NS, name, "--wait=false")
        deadline = t_delete + 300
        while True:
            _, new_uid, ready = _pod_uid(tiny, role)
            if new_uid != uid and ready:
                break
            assert time.monotonic() < deadline, f"{role} pod not back: {results[-5:]}"
            time.sleep(0.5)
        t_ready = time.monotonic()
        while not [r for r in results if r[0] > t_ready and r[2] == "ok"]:
            assert time.monotonic() < t_ready + 120, f"no success after recovery: {results[-5:]}"
            time.sleep(0.2)
    finally:
        stop.set()
        thread.join(timeout=90)
    assert not thread.is_alive(), "a request hung"
    after = [r for r in results if r[1] >= t_delete]
    failures = [r[2] for r in after if r[2] != "ok"]
    # the first request *started* after the delete that succeeded (in-flight ones may finish)
    first_ok = min((r[1] for r in after if r[2] == "ok" and r[0] > t_delete), default=float("nan"))
    real_handle.timings[f"delete {role}: pod back Ready (s)"] = t_ready - t_delete
    real_handle.timings[f"delete {role}: first new request to succeed, after delete (s)"] = (
        first_ok - t_delete
    )
    real_handle.timings[f"delete {role}: failed requests"] = float(len(failures))
    real_handle.notes[f"delete {role}: failure kinds"] = sorted(set(failures))
    assert max(r[1] - r[0] for r in results) < 61, "a request outlived the client timeout"


def test_leader_address_resolves_and_connects_from_another_pod(tiny: Any) -> None:
    """The rendezvous a multi-node instance needs: the name the operator gives an instance's
    rank-0 pod (`<instance>-0.<role Service>`, DSV4_MASTER_ADDR) resolves through CoreDNS and
    accepts connections from another pod. (The tiny instances are single-node, so this checks
    the decode leader's name from the prefill pod, on the KV port: the policies open the engine
    port to the gateway only.)"""
    sts = json.loads(
        tiny.kubectl(
            "get", "statefulsets", "-n", NS, "-l", "serving.dsv4.io/role=decode", "-o", "json"
        )
    )["items"][0]
    leader = f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}"
    prefill, _, _ = _pod_uid(tiny, "prefill")
    kv_port = _port(_pod(tiny, "serving.dsv4.io/role=decode"), "kv")
    script = (
        "import socket, sys; a, p = sys.argv[1], int(sys.argv[2]); "
        "ip = socket.getaddrinfo(a, p)[0][4][0]; "
        "socket.create_connection((a, p), timeout=5).close(); print(ip)"
    )
    out = tiny.kubectl(
        "exec",
        "-n",
        NS,
        prefill,
        "-c",
        "engine",
        "--",
        "python",
        "-c",
        script,
        leader,
        str(kv_port),
    ).strip()
    decode_ip = tiny.kubectl(
        "get", "pod", "-n", NS, f"{sts['metadata']['name']}-0", "-o", "jsonpath={.status.podIP}"
    )
    assert out == decode_ip
