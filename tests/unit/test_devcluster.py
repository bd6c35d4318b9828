"""Pure parts of the local control plane: PKI, node manifests, process handling, config checks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dsv4_devcluster.certs import LocalPKI
from dsv4_devcluster.cluster import ClusterConfig, ClusterError, render_kubeconfig
from dsv4_devcluster.kwok_nodes import KWOK_ANNOTATION, FakeNodeSpec, fake_node


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
    kc = json.loads(render_kubeconfig("https://127.0.0.1:6443", pki.ca.cert, admin, "admin"))
    assert kc["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    assert kc["users"][0]["user"]["client-key"] == str(admin.key)
    assert kc["current-context"] == kc["contexts"][0]["name"]


def test_missing_binaries_are_named(tmp_path: Path) -> None:
    (tmp_path / "etcd").touch()
    with pytest.raises(ClusterError, match="kube-apiserver, kubectl"):
        ClusterConfig(bin_dir=tmp_path, work_dir=tmp_path / "w")


def test_operator_service_checks_kopf_liveness_and_reads_its_own_metrics(tmp_path: Path) -> None:
    from dsv4_devcluster.operator_process import OperatorService

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


def _image_layout(root: Path) -> dict[str, str]:
    """Two images sharing a base layer: app:1 = base + app1, app:2 = base + app2."""
    (root / "blobs" / "sha256").mkdir(parents=True)
    blobs = {"base": b"base layer", "app1": b"project 1", "app2": b"project 2", "cfg": b"{}"}
    digests = {name: _layout_blob(root, data) for name, data in blobs.items()}
    for tag in ("1", "2"):
        manifest = {
            "schemaVersion": 2,
            "config": {"digest": digests["cfg"], "size": 2},
            "layers": [{"digest": digests["base"]}, {"digest": digests[f"app{tag}"]}],
        }
        digests[f"m{tag}"] = _layout_blob(root, json.dumps(manifest).encode())
    index = [
        {
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digests[f"m{tag}"],
            "annotations": {"org.opencontainers.image.ref.name": f"dsv4.local/app:{tag}"},
        }
        for tag in ("1", "2")
    ]
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": index}))
    return digests


def _layout_blob(root: Path, data: bytes) -> str:
    import hashlib

    d = hashlib.sha256(data).hexdigest()
    (root / "blobs" / "sha256" / d).write_bytes(data)
    return f"sha256:{d}"


def test_oci_layout_image_lists_its_metadata_and_layers(tmp_path: Path) -> None:
    from dsv4_devcluster.realnodes import ocilayout

    d = _image_layout(tmp_path)
    assert ocilayout.refs(tmp_path) == ["dsv4.local/app:1", "dsv4.local/app:2"]
    img = ocilayout.image(tmp_path, "dsv4.local/app:2")
    assert img.metadata == (d["m2"], d["cfg"])
    assert img.layers == (d["base"], d["app2"])
    with pytest.raises(
        ocilayout.LayoutError,
        match=re.escape(
            "has no image dsv4.local/app:3 (it has dsv4.local/app:1, dsv4.local/app:2)"
        ),
    ):
        ocilayout.image(tmp_path, "dsv4.local/app:3")


def test_thin_archive_leaves_out_the_layers_a_node_has(tmp_path: Path) -> None:
    import io
    import tarfile

    from dsv4_devcluster.realnodes import ocilayout

    d = _image_layout(tmp_path / "oci")
    img = ocilayout.image(tmp_path / "oci", "dsv4.local/app:2")
    buf = io.BytesIO()
    sent = ocilayout.thin_archive(tmp_path / "oci", img, {d["base"], d["app1"]}, buf)
    assert sent == [d["app2"]]
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        names = tar.getnames()
        index = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
        layer = tar.extractfile(f"blobs/sha256/{d['app2'][7:]}").read()  # type: ignore[union-attr]
    assert names == [
        "oci-layout",
        "index.json",
        *(f"blobs/sha256/{x[7:]}" for x in (d["m2"], d["cfg"], d["app2"])),
    ]
    assert index["manifests"] == [img.descriptor]
    assert layer == b"project 2"
    # a node with nothing gets every layer
    assert ocilayout.thin_archive(tmp_path / "oci", img, [], io.BytesIO()) == [d["base"], d["app2"]]


def test_thin_archive_names_a_missing_blob(tmp_path: Path) -> None:
    import io

    from dsv4_devcluster.realnodes import ocilayout

    d = _image_layout(tmp_path)
    (tmp_path / "blobs" / "sha256" / d["app1"][7:]).unlink()
    img = ocilayout.image(tmp_path, "dsv4.local/app:1")
    with pytest.raises(
        ocilayout.LayoutError, match=re.escape(f"lacks blob {d['app1']} of dsv4.local/app:1")
    ):
        ocilayout.thin_archive(tmp_path, img, [], io.BytesIO())


@pytest.mark.parametrize(
    ("ref", "repo"),
    [
        ("dsv4.local/engine:dev", "dsv4.local/engine"),
        ("registry:5000/engine", "registry:5000/engine"),
        ("registry:5000/engine:1", "registry:5000/engine"),
        ("busybox", "busybox"),
    ],
)
def test_repository_of_a_reference(ref: str, repo: str) -> None:
    from dsv4_devcluster.realnodes.ocilayout import repository

    assert repository(ref) == repo


def test_image_import_retries_only_the_collectors_snapshot_race(tmp_path) -> None:
    from dsv4_devcluster.realnodes.containerd import Containerd
    from dsv4_devcluster.realnodes.node import RealNodeError

    race = "importing x: unpack: parent snapshot sha256:ab does not exist: not found"
    errors = [RealNodeError(race), RealNodeError(race)]
    calls: list[str] = []

    class Flaky(Containerd):
        def _import_once(self, node, ref):  # type: ignore[no-untyped-def]
            calls.append(ref)
            if errors:
                raise errors.pop(0)
            return 7

    assert Flaky(tmp_path).import_image(None, "r") == 7  # type: ignore[arg-type]
    assert calls == ["r", "r", "r"]
    errors[:] = [RealNodeError(race)] * 3
    with pytest.raises(RealNodeError, match="parent snapshot"):
        Flaky(tmp_path).import_image(None, "r")  # type: ignore[arg-type]
    errors[:] = [RealNodeError("importing x: no space left on device")]
    calls.clear()
    with pytest.raises(RealNodeError, match="no space"):
        Flaky(tmp_path).import_image(None, "r")  # type: ignore[arg-type]
    assert calls == ["r"]
