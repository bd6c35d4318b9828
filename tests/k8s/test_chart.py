"""The Helm chart: lint-clean, schema-checked values, renders what the cluster accepts, installs,
and manifests/ is exactly what the generator makes from the single sources."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.k8s.conftest import RELEASE_NAMESPACE, REPO, helm


def test_helm_lint_is_clean(k8s_control_plane) -> None:
    for extra in ([], ["--set", "watchNamespaces={team-a,team-b}", "--set", "replicaCount=2"]):
        res = helm(k8s_control_plane, "lint", "--strict", str(REPO / "charts" / "dsv4"), *extra)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "[WARNING]" not in res.stdout and "[ERROR]" not in res.stdout


def test_values_schema_rejects_bad_values(k8s_control_plane) -> None:
    res = helm(
        k8s_control_plane,
        "template",
        "x",
        str(REPO / "charts" / "dsv4"),
        "--set",
        "replicaCount=-1",
    )
    assert res.returncode != 0
    assert "replicaCount" in res.stderr
    res = helm(
        k8s_control_plane,
        "template",
        "x",
        str(REPO / "charts" / "dsv4"),
        "--set",
        "image.pullPolicy=Sometimes",
    )
    assert res.returncode != 0 and "pullPolicy" in res.stderr


def test_install_creates_operator_crds_and_rbac(k8s_cluster, helm_release) -> None:
    status = helm(k8s_cluster, "status", "dsv4", "-n", RELEASE_NAMESPACE)
    assert "STATUS: deployed" in status.stdout
    crds = k8s_cluster.kubectl("get", "crd", "-o", "name")
    for name in (
        "deepseekv4deployments.serving.dsv4.io",
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    ):
        assert f"customresourcedefinition.apiextensions.k8s.io/{name}" in crds
    k8s_cluster.kubectl(
        "rollout", "status", "deployment/dsv4-operator", "-n", RELEASE_NAMESPACE, "--timeout=90s"
    )
    # least privilege: the operator may not read secrets cluster-wide beyond what it owns... but it
    # has no wildcard and nothing outside its list
    sa = f"system:serviceaccount:{RELEASE_NAMESPACE}:dsv4-operator"
    can = lambda *a: k8s_cluster.kubectl("auth", "can-i", *a, f"--as={sa}", check=False).strip()  # noqa: E731
    assert can("patch", "statefulsets", "-n", "default") == "yes"
    assert can("delete", "nodes") == "no"
    assert can("create", "clusterroles") == "no"
    assert can("create", "pods", "-n", "default") == "no"
    rules = yaml.safe_load_all((REPO / "manifests" / "operator.yaml").read_text())
    for doc in rules:
        for rule in (doc or {}).get("rules", []):
            assert "*" not in rule["verbs"] and "*" not in rule["resources"]


def test_rendered_chart_validates_against_the_cluster(k8s_control_plane, helm_release) -> None:
    for extra in ([], ["--set", "watchNamespaces={default}"]):
        rendered = helm(
            k8s_control_plane,
            "template",
            "dry",
            str(REPO / "charts" / "dsv4"),
            "-n",
            RELEASE_NAMESPACE,
            "--skip-crds",
            *extra,
        )
        assert rendered.returncode == 0, rendered.stderr
        k8s_control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=rendered.stdout)


def test_service_monitor_only_with_prometheus_operator(k8s_control_plane) -> None:
    chart = str(REPO / "charts" / "dsv4")
    without = helm(k8s_control_plane, "template", "x", chart).stdout
    with_api = helm(
        k8s_control_plane,
        "template",
        "x",
        chart,
        "--api-versions",
        "monitoring.coreos.com/v1/ServiceMonitor",
    ).stdout
    assert "kind: ServiceMonitor" not in without
    assert "kind: ServiceMonitor" in with_api


def test_pod_monitor_labels_what_the_dashboard_and_autoscaler_select(k8s_control_plane) -> None:
    chart = str(REPO / "charts" / "dsv4")
    assert "kind: PodMonitor" not in helm(k8s_control_plane, "template", "x", chart).stdout
    out = helm(
        k8s_control_plane,
        "template",
        "x",
        chart,
        "--api-versions",
        "monitoring.coreos.com/v1/PodMonitor",
    ).stdout
    pm = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    assert pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/managed-by"] == "dsv4-operator"
    ports = {e["port"]: e["relabelings"] for e in pm["spec"]["podMetricsEndpoints"]}
    assert set(ports) == {"http", "kv-metrics"}
    for relabel in ports.values():
        targets = {r["targetLabel"] for r in relabel}
        assert targets == {"dsv4_deployment", "role", "component"}
    assert {r.get("replacement") for r in ports["http"] if r["targetLabel"] == "component"} == {
        "engine",
        "gateway",
    }


def test_dashboards_ship_as_sidecar_configmaps(k8s_control_plane) -> None:
    chart = str(REPO / "charts" / "dsv4")
    out = helm(k8s_control_plane, "template", "x", chart, "-n", "mon").stdout
    cms = [
        d
        for d in yaml.safe_load_all(out)
        if d and d["kind"] == "ConfigMap" and "dsv4-overview.json" in (d.get("data") or {})
    ]
    assert len(cms) == 1
    assert cms[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(cms[0]["data"]["dsv4-overview.json"])
    source = json.loads((REPO / "charts/dsv4/dashboards/dsv4-overview.json").read_text())
    assert board == source
    off = helm(
        k8s_control_plane, "template", "x", chart, "--set", "grafanaDashboards.enabled=false"
    )
    assert "dsv4-overview.json" not in off.stdout


def test_manifests_match_their_sources(k8s_control_plane, tmp_path: Path) -> None:
    helm_bin = str(k8s_control_plane.config.bin_dir / "helm")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv4_operator.manifests",
            "--root",
            str(REPO),
            "--helm",
            helm_bin,
            "--out",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.yaml"))
    assert generated, "generator wrote nothing"
    for rel in generated:
        committed = REPO / rel
        assert committed.exists(), (
            f"{rel} is generated but not committed: run scripts/gen-manifests"
        )
        assert committed.read_text() == (tmp_path / rel).read_text(), (
            f"{rel} drifted from its source: run scripts/gen-manifests"
        )


def test_host_access_is_off_unless_a_chart_value_allows_it(k8s_control_plane) -> None:
    chart = str(REPO / "charts" / "dsv4")

    def command(*values: str) -> list[str]:
        res = helm(k8s_control_plane, "template", "x", chart, *values)
        assert res.returncode == 0, res.stderr
        deployment = next(
            d for d in yaml.safe_load_all(res.stdout) if d and d["kind"] == "Deployment"
        )
        cmd: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
        return cmd

    default = command()
    assert "--allow-host-path-models" not in default and "--allow-privileged" not in default
    allowed = command("--set", "hostAccess.modelPath=true", "--set", "hostAccess.privileged=true")
    assert {"--allow-host-path-models", "--allow-privileged"} <= set(allowed)
    res = helm(k8s_control_plane, "template", "x", chart, "--set", "hostAccess.modelPath=yes")
    assert res.returncode != 0 and "modelPath" in res.stderr
