"""The autoscaler end to end on the real control plane (kwok nodes): the operator reads its
metrics from a stub that stands in for the gateway, engine and sidecar (kwok pods run no
process), scales, drains and reports."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from dsv4_common.process import metric_value
from tests.helpers import wait_for
from tests.k8s.autoscaling_stub import MetricsStub
from tests.k8s.operator_fixtures import OperatorService, apply_yaml, kubectl_json
from tests.k8s.prometheus_server import PrometheusService
from tests.k8s.prometheus_server import available as prometheus_available
from tests.k8s.test_operator import _children, _status
from tests.k8s.test_operator_reliability import _cpu_cr

FAST = {
    "enabled": True,
    "intervalSeconds": 1,
    "windowSeconds": 3,
    "scaleDownStabilizationSeconds": 5,
    "drainTimeoutSeconds": 300,
    "prefill": {"min": 1, "max": 2},
    "decode": {"min": 1, "max": 1},
}


def _cr(name: str, autoscaling: dict[str, Any], **spec: Any) -> dict[str, Any]:
    cr = _cpu_cr(name, autoscaling=autoscaling, **spec)
    cr["spec"]["prefill"] = {"npusPerNode": 0, "parallelism": {"tp": 1}, **spec.get("prefill", {})}
    return cr


@pytest.fixture(scope="module")
def stub() -> Iterator[MetricsStub]:
    with MetricsStub() as s:
        yield s


def _launch(k8s_cluster: Any, kubeconfig: Any, stub: MetricsStub) -> OperatorService:
    extra = ("--autoscaler-metrics-address", stub.address, "--autoscaler-blocked-after", "3")
    return OperatorService(kubeconfig, k8s_cluster.log_dir, extra).launch()


@pytest.fixture(scope="module")
def scaler(k8s_cluster: Any, operator_kubeconfig: Any, stub: MetricsStub) -> Iterator[list[Any]]:
    """The operator, pointed at the stub; a list so a test can replace it (restart)."""
    procs = [_launch(k8s_cluster, operator_kubeconfig, stub)]
    yield procs
    procs[-1].stop()


def _events(cluster: Any, ns: str, name: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = kubectl_json(
        cluster, "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name}"
    )["items"]
    return sorted(items, key=lambda e: int(e["metadata"]["resourceVersion"]))


def _reasons(cluster: Any, ns: str, name: str) -> list[str]:
    return [e["reason"] for e in _events(cluster, ns, name)]


def _cond(st: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions") or [] if c["type"] == ctype), {})


def _limited(cluster: Any, ns: str, name: str, reason: str) -> dict[str, Any] | None:
    """The status once its ScalingLimited condition has ``reason``."""
    st = _status(cluster, ns, name)
    return st if _cond(st, "ScalingLimited").get("reason") == reason else None


def _routing(cluster: Any, ns: str, name: str) -> list[str]:
    cm = kubectl_json(cluster, "get", "configmap", f"{name}-routing", "-n", ns)
    draining: list[str] = json.loads(cm["data"]["routing.json"])["draining"]
    return draining


def _idle_then_removed(cluster: Any, stub: MetricsStub, ns: str, name: str, victim: str) -> None:
    """The victim goes idle: its StatefulSet is deleted, DrainCompleted before ScaledDown."""
    stub.set(running=0)
    wait_for(
        f"{victim} deleted",
        lambda: f"StatefulSet/{victim}" not in _children(cluster, ns, name),
        timeout_s=60,
    )
    reasons = _reasons(cluster, ns, name)
    assert reasons.index("DrainCompleted") < reasons.index("ScaledDown"), reasons


def _stays(what: str, fn: Any, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert fn(), f"{what} no longer holds"
        time.sleep(0.5)


def test_scale_up_drain_restart_and_timeout(
    k8s_cluster: Any, operator_kubeconfig: Any, scaler: list[Any], stub: MetricsStub, namespace: str
) -> None:
    cluster, ns, name = k8s_cluster, namespace, "auto"
    stub.set(prefill_waiting=0, decode_waiting=0, running=0, waiting=0, exports=0)
    apply_yaml(cluster, json.dumps(_cr(name, FAST)), ns)

    # active, reporting: TTFT/TPOT columns filled from the window's p90
    st = wait_for(
        "status.autoscaling and metrics",
        lambda: (s := _status(cluster, ns, name)).get("metrics", {}).get("tpot") and s,
        timeout_s=60,
    )
    # p90 interpolated inside the bucket holding every sample: 0.05 + 0.9 x 0.05 s for TTFT
    # (samples of 0.08 s), 10 + 0.9 x 15 ms for TPOT (samples of 20 ms)
    assert st["metrics"] == {"ttft": "0.095s", "tpot": "23.5ms"}
    assert _cond(st, "AutoscalingActive")["status"] == "True"
    assert st["autoscaling"]["source"] == "Gateway"
    table = cluster.kubectl("get", "dsv4", name, "-n", ns).splitlines()
    head = ["NAME", "PREFILL", "DECODE", "PHASE", "UPDATED", "TTFT", "TPOT", "AGE"]
    assert table[0].split() == head
    assert table[1].split()[5:7] == ["0.095s", "23.5ms"]

    # prefill queue 10 per instance (>= 1.5 x 2: at once): 1 -> 2, a new StatefulSet, ScaledUp
    stub.set(prefill_waiting=10)
    wait_for("prefill desired 2", lambda: _status(cluster, ns, name)["prefill"]["desired"] == 2)
    wait_for(
        "StatefulSet auto-prefill-1",
        lambda: f"StatefulSet/{name}-prefill-1" in _children(cluster, ns, name),
    )
    assert "ScaledUp" in _reasons(cluster, ns, name)
    wide = cluster.kubectl("get", "dsv4", name, "-n", ns, "-o", "wide").splitlines()
    assert wide[0].split() == [
        "NAME",
        "PREFILL",
        "DECODE",
        "PHASE",
        "UPDATED",
        "REVISION",
        "TTFT",
        "TPOT",
        "SCALING",
        "AGE",
    ]

    # max respected: still short, still 2, and the limit is said
    st = wait_for("ScalingLimited AtMax", lambda: _limited(cluster, ns, name, "AtMax"))
    assert st["prefill"]["desired"] == 2 and st["decode"]["desired"] == 1
    _stays(
        "no third prefill instance",
        lambda: f"StatefulSet/{name}-prefill-2" not in _children(cluster, ns, name),
        3,
    )

    # load drops; the victim still has requests: listed draining, its StatefulSet stays, and
    # its engine is asked to move its streams (POST /drain, migrate: the stub says 2 move)
    stub.migrating = 2
    stub.set(prefill_waiting=0, running=3)
    st = wait_for(
        "prefill-1 draining",
        lambda: (s := _status(cluster, ns, name))["prefill"].get("draining") and s,
        timeout_s=60,
    )
    assert st["prefill"]["draining"] == [f"{name}-prefill-1"] and st["prefill"]["desired"] == 1
    assert _routing(cluster, ns, name) == [f"{name}-prefill-1"]
    assert "DrainStarted" in _reasons(cluster, ns, name)
    wait_for("POST /drain", lambda: stub.drains("POST"))
    assert set(map(json.dumps, stub.drains("POST"))) == {'{"migrate": true}'}
    migrating = wait_for(
        "DrainMigrating",
        lambda: [
            e["message"] for e in _events(cluster, ns, name) if e["reason"] == "DrainMigrating"
        ],
    )
    assert migrating == [
        f"prefill instance {name}-prefill-1: 2 stream(s) moving with their KV, 3 in flight"
    ]
    _stays(
        "the busy victim's StatefulSet",
        lambda: f"StatefulSet/{name}-prefill-1" in _children(cluster, ns, name),
        4,
    )

    # the operator dies mid-drain; its successor resumes the drain from the status
    scaler[-1].stop()
    scaler.append(_launch(cluster, operator_kubeconfig, stub))
    _stays(
        "the drain across the restart",
        lambda: (
            _status(cluster, ns, name)["prefill"].get("draining") == [f"{name}-prefill-1"]
            and f"StatefulSet/{name}-prefill-1" in _children(cluster, ns, name)
        ),
        4,
    )

    # idle: DrainCompleted, then the StatefulSet goes, then ScaledDown
    _idle_then_removed(cluster, stub, ns, name, f"{name}-prefill-1")
    wait_for(
        "draining emptied", lambda: _status(cluster, ns, name)["prefill"].get("draining") == []
    )
    assert _routing(cluster, ns, name) == []

    # the operator's own metrics say what it decided
    metrics = urllib.request.urlopen(f"{scaler[-1].url}/metrics", timeout=10).read().decode()
    assert (
        metric_value(
            metrics,
            "dsv4_autoscaler_desired_instances",
            namespace=ns,
            deployment=name,
            role="prefill",
        )
        == 1.0
    )
    assert (
        metric_value(
            metrics,
            "dsv4_autoscaler_signal",
            deployment=name,
            role="prefill",
            signal="waitingPerInstance",
        )
        == 0.0
    )

    # load returns during a drain: the victim is taken back (DrainCancelled), no new instance
    stub.set(prefill_waiting=10, running=5)
    wait_for(
        "StatefulSet auto-prefill-1 again",
        lambda: f"StatefulSet/{name}-prefill-1" in _children(cluster, ns, name),
    )
    stub.set(prefill_waiting=0)
    wait_for(
        "prefill-1 draining again",
        lambda: _status(cluster, ns, name)["prefill"].get("draining") == [f"{name}-prefill-1"],
        timeout_s=60,
    )
    deletes = len(stub.drains("DELETE"))
    stub.set(prefill_waiting=10)
    wait_for("DrainCancelled", lambda: "DrainCancelled" in _reasons(cluster, ns, name))
    wait_for("DELETE /drain of the victim", lambda: len(stub.drains("DELETE")) > deletes)
    st = wait_for(
        "draining emptied by the cancel",
        lambda: (s := _status(cluster, ns, name))["prefill"].get("draining") == [] and s,
    )
    assert st["prefill"]["desired"] == 2
    assert f"StatefulSet/{name}-prefill-1" in _children(cluster, ns, name)
    metrics = urllib.request.urlopen(f"{scaler[-1].url}/metrics", timeout=10).read().decode()
    assert (
        metric_value(
            metrics,
            "dsv4_autoscaler_decisions_total",
            deployment=name,
            role="prefill",
            direction="up",
        )
        >= 1.0
    )

    # a drain that does not finish in drainTimeoutSeconds: DrainTimedOut, deleted anyway
    cluster.kubectl(
        "patch",
        "dsv4",
        name,
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"autoscaling": {"drainTimeoutSeconds": 3}}}),
    )
    stub.set(prefill_waiting=0)
    wait_for("DrainTimedOut", lambda: "DrainTimedOut" in _reasons(cluster, ns, name), timeout_s=60)
    wait_for(
        "prefill-1 deleted after the timeout",
        lambda: f"StatefulSet/{name}-prefill-1" not in _children(cluster, ns, name),
        timeout_s=30,
    )
    cluster.kubectl("delete", "dsv4", name, "-n", ns, "--wait=true")


def test_an_unschedulable_new_instance_blocks_further_scale_up(
    k8s_cluster: Any, scaler: list[Any], stub: MetricsStub, namespace: str
) -> None:
    cluster, ns, name = k8s_cluster, namespace, f"blk-{uuid.uuid4().hex[:4]}"
    stub.set(prefill_waiting=0, decode_waiting=0, running=0, waiting=0, exports=0)
    # one node, and a prefill engine needing more than half of it: the second cannot be placed
    cr = _cr(
        name,
        dict(FAST, prefill={"min": 1, "max": 4}),
        prefill={"resources": {"requests": {"cpu": "100"}}},
        scheduling={"nodeSelector": {"kubernetes.io/hostname": cluster.nodes[0]}},
    )
    apply_yaml(cluster, json.dumps(cr), ns)
    wait_for(
        "prefill 1/1",
        lambda: _status(cluster, ns, name).get("prefill", {}).get("summary") == "1/1",
        timeout_s=90,
    )
    stub.set(prefill_waiting=10)
    wait_for(
        "ScaleUpBlocked", lambda: "ScaleUpBlocked" in _reasons(cluster, ns, name), timeout_s=60
    )
    # the event is posted as the tick ends; the sync it asked for writes the status just after
    st = wait_for(
        "ScalingLimited ScaleUpBlocked",
        lambda: _limited(cluster, ns, name, "ScaleUpBlocked"),
    )
    assert st["prefill"]["desired"] == 2
    _stays(
        "no third prefill instance",
        lambda: (
            f"StatefulSet/{name}-prefill-2" not in _children(cluster, ns, name)
            and _status(cluster, ns, name)["prefill"]["desired"] == 2
        ),
        4,
    )
    stub.set(prefill_waiting=0)
    cluster.kubectl("delete", "dsv4", name, "-n", ns, "--wait=true")


def _utc(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(epoch))


def test_a_scheduled_minimum_scales_up_at_its_start_and_back_after_its_end(
    k8s_cluster: Any, scaler: list[Any], stub: MetricsStub, namespace: str
) -> None:
    """No load at all: the window alone takes prefill 1 -> 2 at its start and, after its end
    and the stabilisation window, back through a drain. The window is added once the deployment
    is up, a few seconds ahead: its start does not depend on how long the deployment took."""
    cluster, ns, name = k8s_cluster, namespace, f"sch-{uuid.uuid4().hex[:4]}"
    stub.set(prefill_waiting=0, decode_waiting=0, running=0, waiting=0, exports=0)
    apply_yaml(cluster, json.dumps(_cr(name, FAST)), ns)
    wait_for(
        "prefill 1/1",
        lambda: _status(cluster, ns, name).get("prefill", {}).get("summary") == "1/1",
        timeout_s=90,
    )
    start = time.time() + 7
    window = {"name": "peak", "start": _utc(start), "end": _utc(start + 6), "prefill": 2}
    patch = {"spec": {"autoscaling": {"scheduledMinimums": [window]}}}
    cluster.kubectl("patch", "dsv4", name, "-n", ns, "--type=merge", "-p", json.dumps(patch))
    assert time.time() < start - 3, "the patch took too long for this test"
    _stays(
        "one prefill instance before the window",
        lambda: f"StatefulSet/{name}-prefill-1" not in _children(cluster, ns, name),
        start - 1.5 - time.time(),
    )
    wait_for(
        "StatefulSet prefill-1",
        lambda: f"StatefulSet/{name}-prefill-1" in _children(cluster, ns, name),
        timeout_s=15,
    )
    up = next(e for e in _events(cluster, ns, name) if e["reason"] == "ScaledUp")
    assert (
        f"prefill 1->2: scheduled minimum 'peak' ({window['start']}-{window['end']} UTC)"
        in (up["message"])
    ), up["message"]
    assert time.time() >= start - 1.0  # not before its start (1 s ticks, second-resolution times)
    _stays(
        "two prefill instances during the window",
        lambda: f"StatefulSet/{name}-prefill-1" in _children(cluster, ns, name),
        start + 5 - time.time(),
    )
    # after the end, the 5 s stabilisation, then the usual drain (the stub says idle)
    _idle_then_removed(cluster, stub, ns, name, f"{name}-prefill-1")
    assert time.time() >= start + 6 + 4
    cluster.kubectl("delete", "dsv4", name, "-n", ns, "--wait=true")


def test_external_mode_follows_the_role_scale_clamped_and_drains(
    k8s_cluster: Any, scaler: list[Any], stub: MetricsStub, namespace: str
) -> None:
    cluster, ns, name = k8s_cluster, namespace, "ext"
    stub.set(prefill_waiting=0, decode_waiting=0, running=0, waiting=0, exports=0)
    apply_yaml(cluster, json.dumps(_cr(name, dict(FAST, mode="External"))), ns)
    wait_for(
        "the role scale objects",
        lambda: (
            {"DeepSeekV4RoleScale/ext-prefill", "DeepSeekV4RoleScale/ext-decode"}
            <= set(_scales(cluster, ns))
        ),
    )
    # what an HPA does: write replicas through the scale subresource
    cluster.kubectl("scale", "dsv4rs", f"{name}-prefill", "-n", ns, "--replicas=2")
    wait_for("prefill desired 2", lambda: _status(cluster, ns, name)["prefill"]["desired"] == 2)
    wait_for(
        "StatefulSet ext-prefill-1",
        lambda: f"StatefulSet/{name}-prefill-1" in _children(cluster, ns, name),
    )
    path = (
        f"/apis/serving.dsv4.io/v1alpha1/namespaces/{ns}/deepseekv4rolescales/{name}-prefill/scale"
    )
    scale = wait_for(
        "the scale's status",
        lambda: (
            (s := json.loads(cluster.kubectl("get", "--raw", path)))["status"].get("replicas") == 2
            and s
        ),
    )
    assert scale["status"]["selector"] == (
        f"app.kubernetes.io/instance={name},apps.kubernetes.io/pod-index=0,"
        "serving.dsv4.io/role=prefill"
    )
    # above max: clamped, and said
    cluster.kubectl("scale", "dsv4rs", f"{name}-prefill", "-n", ns, "--replicas=5")
    st = wait_for("ScalingLimited AtMax", lambda: _limited(cluster, ns, name, "AtMax"))
    assert st["prefill"]["desired"] == 2
    assert st["autoscaling"]["source"] == "External"
    # down: through a drain, as the operator's own decisions
    stub.set(running=2)
    cluster.kubectl("scale", "dsv4rs", f"{name}-prefill", "-n", ns, "--replicas=1")
    wait_for(
        "prefill-1 draining",
        lambda: _status(cluster, ns, name)["prefill"].get("draining") == [f"{name}-prefill-1"],
    )
    assert f"StatefulSet/{name}-prefill-1" in _children(cluster, ns, name)
    _idle_then_removed(cluster, stub, ns, name, f"{name}-prefill-1")
    cluster.kubectl("delete", "dsv4", name, "-n", ns, "--wait=true")


def _scales(cluster: Any, ns: str) -> list[str]:
    items = kubectl_json(cluster, "get", "dsv4rs", "-n", ns)["items"]
    return [f"{o['kind']}/{o['metadata']['name']}" for o in items]


@pytest.mark.skipif(not prometheus_available(), reason="needs the prometheus binary")
def test_prometheus_source_scales_and_reports(
    k8s_cluster: Any, scaler: list[Any], stub: MetricsStub, namespace: str, tmp_path: Any
) -> None:
    cluster, ns, name = k8s_cluster, namespace, "prom"
    stub.set(prefill_waiting=0, decode_waiting=0, running=0, waiting=0, exports=0)
    prom = PrometheusService(tmp_path / "prometheus", stub.address, name, ns)
    prom.start()
    try:
        prom.wait_ready(60)
        source = {"source": "Prometheus", "prometheusURL": prom.url}
        apply_yaml(cluster, json.dumps(_cr(name, dict(FAST, metrics=source))), ns)
        st = wait_for(
            "status.metrics from Prometheus",
            lambda: (s := _status(cluster, ns, name)).get("metrics", {}).get("tpot") and s,
            timeout_s=60,
        )
        # histogram_quantile interpolates inside the bucket as the gateway source does
        assert st["metrics"] == {"ttft": "0.095s", "tpot": "23.5ms"}
        assert st["autoscaling"]["source"] == "Prometheus"
        assert _cond(st, "AutoscalingActive")["status"] == "True"
        # the engines' queue (vllm:num_requests_waiting, role prefill) goes to 10: 1 -> 2
        stub.set(waiting=10)
        wait_for("prefill desired 2", lambda: _status(cluster, ns, name)["prefill"]["desired"] == 2)
        assert "ScaledUp" in _reasons(cluster, ns, name)
        stub.set(waiting=0)
        cluster.kubectl("delete", "dsv4", name, "-n", ns, "--wait=true")
    finally:
        prom.stop()
