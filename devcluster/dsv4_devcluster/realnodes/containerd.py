"""Each real node's containerd: its root (kept between sessions when this one can lock it), its
configuration, the images imported into it, and ``crictl``/``ctr`` against it."""

from __future__ import annotations

import fcntl
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from dsv4_devcluster.realnodes import ocilayout
from dsv4_devcluster.realnodes.node import RealNode, RealNodeError
from dsv4_devcluster.realnodes.node_config import cni_config, containerd_config
from dsv4_devcluster.realnodes.supervisor import Supervisor


@dataclass
class Containerd:
    bin_dir: Path
    layout: Path | None = None
    """The OCI image layout ``scripts/node-images`` writes."""
    cache: Path | None = None
    """Where each node's containerd root is kept between sessions (``real-<i>``); None: a fresh
    root per session in the work dir."""
    _locks: list[int] = field(default_factory=list)

    def root(self, name: str, node_dir: Path) -> tuple[Path, bool]:
        """The cached root of node ``name`` if no other session holds it (a lock held while the
        node runs, released by the kernel if this process dies), else a fresh one; and whether
        it was used before."""
        if self.cache is not None:
            self.cache.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.cache / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
            else:
                self._locks.append(fd)
                root = self.cache / name
                reused = (root / "io.containerd.metadata.v1.bolt").exists()
                return root, reused
        return node_dir / "containerd" / "root", False

    def release(self) -> None:
        """Unlock the cached roots (after the nodes stopped)."""
        for fd in self._locks:
            os.close(fd)
        self._locks.clear()

    def start(self, sup: Supervisor, node: RealNode) -> None:
        c = node.dir / "containerd"
        cni_conf = node.dir / "cni" / "net.d"
        if not str(node.root).startswith(str(sup.work_dir)):
            sup.ledger.add("mount_roots", str(node.root))
        for d in (node.root, c / "state", cni_conf):
            d.mkdir(parents=True, exist_ok=True)
        (cni_conf / "10-dsv4.conflist").write_text(cni_config(node, node.dir / "cni" / "ipam"))
        (c / "config.toml").write_text(containerd_config(node, cni_conf))
        sup.ledger.add("sockets", str(node.socket))
        sup.ledger.add("bridges", node.cni_bridge)
        node.containerd = sup.spawn(
            f"containerd-{node.name}", ["containerd", "--config", str(c / "config.toml")]
        )
        sup.wait(
            f"containerd of {node.name}",
            lambda: (
                subprocess.run(
                    ["ctr", "-a", str(node.socket), "version"], capture_output=True
                ).returncode
                == 0
            ),
        )
        if node.root_reused:
            # What a session that died left in the kept root (its sandboxes and containers,
            # whose state dir is gone): removed before the kubelet could see it.
            self.crictl(node, "rmp", "-fa")
            self.crictl(node, "rm", "-fa")

    def crictl(self, node: RealNode, *args: str) -> None:
        crictl = [str(self.bin_dir / "crictl"), "-r", f"unix://{node.socket}", "-t", "20s"]
        subprocess.run([*crictl, *args], capture_output=True, timeout=120)

    def ctr(self, node: RealNode, *args: str, timeout: float = 600) -> str:
        res = subprocess.run(
            ["ctr", "-a", str(node.socket), "-n", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if res.returncode != 0:
            raise RealNodeError(f"ctr {' '.join(args)} on {node.name}: {res.stderr.strip()}")
        return res.stdout

    def import_image(self, node: RealNode, ref: str, attempts: int = 3) -> int:
        """Import the layout's image ``ref`` into the node's containerd, sending only the layers
        its content store lacks; returns the bytes of layers sent.

        Re-importing a tag that moved leaves the old image's snapshots unreferenced, and
        containerd's collector may remove a parent the unpacker has just found and shares
        ("parent snapshot ... does not exist", containerd issue 3787): the next attempt finds
        the parent gone and unpacks it again."""
        for attempt in range(1, attempts + 1):
            try:
                return self._import_once(node, ref)
            except RealNodeError as e:
                if attempt == attempts or not _is_snapshot_race(str(e)):
                    raise
        raise AssertionError("unreachable")

    def _import_once(self, node: RealNode, ref: str) -> int:
        if self.layout is None:
            raise RealNodeError(f"no image layout to import {ref} from")
        img = ocilayout.image(self.layout, ref)
        have = self.ctr(node, "content", "ls", "-q").split()
        argv = ["ctr", "-a", str(node.socket), "-n", "k8s.io", "images", "import"]
        # the archive names the image by its full reference; --base-name keeps exactly that name
        argv += ["--all-platforms", "--base-name", ocilayout.repository(ref), "-"]
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        assert proc.stdin is not None and proc.stdout is not None
        layers: list[str] = []
        try:
            layers = ocilayout.thin_archive(self.layout, img, have, proc.stdin)
        except BrokenPipeError:
            pass  # ctr failed: its output says why
        finally:
            proc.stdin.close()
        out = proc.stdout.read().decode(errors="replace")
        if proc.wait(timeout=600) != 0:
            raise RealNodeError(f"importing {ref} into {node.name}: {out.strip()}")
        return sum(ocilayout.blob_path(self.layout, d).stat().st_size for d in layers)


def _is_snapshot_race(message: str) -> bool:
    """Whether an import failed on a parent snapshot the collector removed under it."""
    return "parent snapshot" in message and "does not exist" in message
