"""Pure parts of the local control plane: PKI, node manifests, process handling, config checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dsv4_operator.devcluster.certs import LocalPKI
from dsv4_operator.devcluster.cluster import ClusterConfig, ClusterError, _kubeconfig
from dsv4_operator.devcluster.nodes import KWOK_ANNOTATION, FakeNodeSpec, fake_node


def test_serving_cert_chains_to_ca_with_sans(tmp_path: Path) -> None:
    pki = LocalPKI(tmp_path)
    pair = pki.issue(
        "apiserver", "kube-apiserver", server_hosts=["127.0.0.1", "kubernetes"], client=False
    )
    ca = x509.load_pem_x509_certificate(pki.ca.cert.read_bytes())
    cert = x509.load_pem_x509_certificate(pair.cert.read_bytes())
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert sans.get_values_for_type(x509.DNSName) == ["kubernetes"]
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert oct(pair.key.stat().st_mode & 0o777) == "0o600"


def test_client_cert_carries_group_as_organization(tmp_path: Path) -> None:
    pair = LocalPKI(tmp_path).issue("admin", "dsv4-admin", org="system:masters")
    cert = x509.load_pem_x509_certificate(pair.cert.read_bytes())
    assert (
        cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    )
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "dsv4-admin"


def test_fake_node_advertises_npus_and_is_managed_by_kwok() -> None:
    node = fake_node(
        "n0", FakeNodeSpec(npu_resource="huawei.com/Ascend310P", npus=4, labels={"zone": "a"})
    )
    assert node["status"]["capacity"]["huawei.com/Ascend310P"] == "4"
    assert node["status"]["allocatable"] == node["status"]["capacity"]
    assert node["metadata"]["annotations"][KWOK_ANNOTATION] == "fake"
    assert node["metadata"]["labels"]["zone"] == "a"
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "n0"


def test_kubeconfig_points_at_server_and_client_cert(tmp_path: Path) -> None:
    pki = LocalPKI(tmp_path)
    admin = pki.issue("admin", "a", org="system:masters")
    kc = json.loads(_kubeconfig("https://127.0.0.1:6443", pki.ca.cert, admin, "admin"))
    assert kc["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    assert kc["users"][0]["user"]["client-key"] == str(admin.key)
    assert kc["current-context"] == kc["contexts"][0]["name"]


def test_missing_binaries_are_named(tmp_path: Path) -> None:
    (tmp_path / "etcd").touch()
    with pytest.raises(ClusterError, match="kube-apiserver, kubectl"):
        ClusterConfig(bin_dir=tmp_path, work_dir=tmp_path / "w")


def test_operator_service_checks_kopf_liveness_and_reads_its_own_metrics(tmp_path: Path) -> None:
    from dsv4_operator.devcluster.operator_process import OperatorService

    op = OperatorService(tmp_path / "sa.kubeconfig", tmp_path, extra=("--priority", "100"))
    assert op.argv[1:] == [
        "-m",
        "dsv4_common.cli",
        "operator",
        "--kubeconfig",
        str(tmp_path / "sa.kubeconfig"),
        "--health-port",
        str(op.health_port),
        "--metrics-port",
        str(op.metrics_port),
        "--priority",
        "100",
    ]
    assert op.health_url == f"http://127.0.0.1:{op.health_port}/healthz"
    assert op.url == f"http://127.0.0.1:{op.metrics_port}"
    assert op.log_path.parent == tmp_path
