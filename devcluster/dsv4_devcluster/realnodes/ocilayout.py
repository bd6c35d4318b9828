"""Images for real nodes from one OCI image layout (``scripts/node-images`` writes it): a node's
containerd is sent an archive of only the blobs it lacks.

The layout's layers are uncompressed, so a layer's digest is its content's and is the same in
every build: after the first import of the engine image (4.7 GB, nearly all of it the dependency
layer), a new commit's image reaches a node as its manifest, config and project layer, a few MB.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

REF_ANNOTATION = "org.opencontainers.image.ref.name"
LAYOUT_FILE = '{"imageLayoutVersion": "1.0.0"}'


class LayoutError(RuntimeError):
    pass


@dataclass(frozen=True)
class ImageBlobs:
    """One image of the layout: its index entry and the digests it is made of."""

    ref: str
    descriptor: dict[str, Any]
    metadata: tuple[str, ...]
    """Manifests (and indexes) and configs: small, always sent (the importer reads them)."""
    layers: tuple[str, ...]
    """Layers: sent only to a node that lacks them."""


def blob_path(layout: Path, digest: str) -> Path:
    algo, _, hexpart = digest.partition(":")
    if not hexpart or "/" in digest:
        raise LayoutError(f"bad digest {digest!r} in {layout}")
    return layout / "blobs" / algo / hexpart


def repository(ref: str) -> str:
    """``registry/name:tag`` -> ``registry/name`` (a port's colon is not a tag's)."""
    name, sep, tag = ref.rpartition(":")
    return name if sep and "/" not in tag else ref


def refs(layout: Path) -> list[str]:
    """The image references the layout names."""
    return [r for d in _index(layout) if (r := d.get("annotations", {}).get(REF_ANNOTATION))]


def image(layout: Path, ref: str) -> ImageBlobs:
    """The blobs of the image named ``ref``."""
    found = [d for d in _index(layout) if d.get("annotations", {}).get(REF_ANNOTATION) == ref]
    if not found:
        raise LayoutError(f"{layout} has no image {ref} (it has {', '.join(refs(layout))})")
    descriptor = found[-1]
    metadata: list[str] = []
    layers: list[str] = []
    todo = [descriptor["digest"]]
    while todo:
        digest = todo.pop()
        if digest in metadata:
            continue
        metadata.append(digest)
        doc = json.loads(blob_path(layout, digest).read_text())
        todo += [m["digest"] for m in doc.get("manifests", [])]
        if doc.get("config"):
            metadata.append(doc["config"]["digest"])
        layers += [la["digest"] for la in doc.get("layers", []) if la["digest"] not in layers]
    return ImageBlobs(ref, descriptor, tuple(metadata), tuple(layers))


def thin_archive(layout: Path, img: ImageBlobs, have: Iterable[str], out: IO[bytes]) -> list[str]:
    """Write an OCI archive of ``img`` that leaves out the layers in ``have`` (digests the node's
    content store holds) to ``out``; returns the layers it carried."""
    present = set(have)
    sent = [d for d in img.layers if d not in present]
    with tarfile.open(fileobj=out, mode="w|") as tar:
        _add_bytes(tar, "oci-layout", LAYOUT_FILE.encode())
        index = {"schemaVersion": 2, "manifests": [img.descriptor]}
        _add_bytes(tar, "index.json", json.dumps(index).encode())
        for digest in [*img.metadata, *sent]:
            path = blob_path(layout, digest)
            if not path.is_file():
                raise LayoutError(f"{layout} lacks blob {digest} of {img.ref}")
            algo, _, hexpart = digest.partition(":")
            tar.add(path, arcname=f"blobs/{algo}/{hexpart}", recursive=False)
    return sent


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def _index(layout: Path) -> list[dict[str, Any]]:
    path = layout / "index.json"
    try:
        manifests: list[dict[str, Any]] = json.loads(path.read_text())["manifests"]
    except (OSError, ValueError, KeyError) as e:
        raise LayoutError(f"{path}: not an OCI image layout ({e}): run scripts/node-images") from e
    return manifests
