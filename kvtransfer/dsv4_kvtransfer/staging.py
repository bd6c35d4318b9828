"""The host staging region: one POSIX shared-memory file the sidecar and its engine both map.

The sidecar creates it under ``/dev/shm`` (in a pod: the in-memory emptyDir shared by the engine
and sidecar containers), reserves its pages up front (``posix_fallocate``: a /dev/shm too small
fails here with a clear message instead of a SIGBUS mid-transfer), and unlinks it on exit. The
engine attaches by name. Plain ``mmap`` on purpose: ``multiprocessing.shared_memory`` registers
attached segments with Python's resource tracker, which unlinks them when the *attaching*
process exits.

The first ``HEADER_BYTES`` hold a magic, the region size and a random tag; a same-host peer that
maps the region by name checks the tag to be sure it opened the right segment.

A committed export may carry a **trailer** right after its bytes (inside its extent): a live
marker, its transfer id and its manifest (``publish``). A same-host puller reads the manifest
there and copies the bytes without asking the owner first; the marker is cleared (``retire``)
under the owner's lock before the export stops being pullable or its extent is freed, so a
marker read intact after the copy proves the bytes copied were the export's all along (``Trailer``).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import struct
import threading
from pathlib import Path

HEADER_BYTES = 4096
_MAGIC = b"DSV4KVSTAGING\x00\x00\x01"
_HEADER = struct.Struct("!16sQ16s")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")
# map every page up front: a first transfer would otherwise pay a page fault per 4 KiB
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
# an export's trailer: live marker, transfer id (length, bytes), manifest length; the manifest
TRAILER = struct.Struct("!8sB64sI")
_LIVE = b"DSV4KVEX"
_DEAD = bytes(8)
MAX_MANIFEST = 16 << 20


class StagingError(Exception):
    pass


class StagingRegion:
    """A mapped staging region; ``view(offset, n)`` gives zero-copy memoryviews into it."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, size: int, tag: bytes, owner: bool):
        self.path = path
        self.size = size
        self.tag = tag
        self.tag_hex = tag.hex()
        self.owner = owner
        self._fd = fd
        self._mm = mm
        self._mv = memoryview(mm)

    @property
    def name(self) -> str:
        return self.path.name

    @staticmethod
    def _path(name: str, directory: str | os.PathLike[str]) -> Path:
        if not _NAME.match(name):
            raise StagingError(f"bad shared-memory name {name!r}")
        return Path(directory) / name

    @classmethod
    def create(
        cls, name: str, size: int, directory: str | os.PathLike[str] = "/dev/shm"
    ) -> StagingRegion:
        if size <= HEADER_BYTES:
            raise StagingError(f"staging size {size} must exceed {HEADER_BYTES} bytes")
        path = cls._path(name, directory)
        if path.exists():
            # a previous sidecar with this name died without cleaning up (SIGKILL, OOM)
            path.unlink()
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise StagingError(f"cannot create the staging region {path}: {e.strerror}") from None
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise
                free = _free_bytes(path.parent)
                raise StagingError(
                    f"cannot reserve {size} bytes for the staging region in {path.parent} "
                    f"({free} bytes free): enlarge the /dev/shm volume or lower --staging-bytes"
                ) from None
            mm = mmap.mmap(fd, size, _MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        tag = secrets.token_bytes(16)
        mm[: _HEADER.size] = _HEADER.pack(_MAGIC, size, tag)
        return cls(path, fd, mm, size, tag, owner=True)

    @classmethod
    def attach(
        cls, name: str, directory: str | os.PathLike[str] = "/dev/shm", writable: bool = True
    ) -> StagingRegion:
        path = cls._path(name, directory)
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except OSError as e:
            raise StagingError(f"cannot open the staging region {path}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size <= HEADER_BYTES:
                raise StagingError(f"{path} is not a staging region ({size} bytes)")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, size, _MAP_FLAGS, prot)
        except BaseException:
            os.close(fd)
            raise
        magic, hsize, tag = _HEADER.unpack(mm[: _HEADER.size])
        if magic != _MAGIC or hsize != size:
            mm.close()
            os.close(fd)
            raise StagingError(f"{path} is not a dsv4 staging region")
        return cls(path, fd, mm, size, tag, owner=False)

    def view(self, offset: int, nbytes: int) -> memoryview:
        if offset < HEADER_BYTES or nbytes < 0 or offset + nbytes > self.size:
            raise StagingError(
                f"range [{offset}, {offset + nbytes}) is outside the region's data "
                f"[{HEADER_BYTES}, {self.size})"
            )
        return self._mv[offset : offset + nbytes]

    # ---- export trailers (the owner writes them, same-host pullers read them) ----------------

    def publish(self, at: int, transfer_id: str, manifest: bytes) -> None:
        """Write an export's trailer at ``at`` (right after its bytes): the manifest and the
        transfer id first, the live marker last."""
        tid = transfer_id.encode()
        end = at + TRAILER.size + len(manifest)
        if at < HEADER_BYTES or end > self.size or len(tid) > 64:
            raise StagingError(f"no trailer of {transfer_id!r} fits in [{at}, {end})")
        head = TRAILER.pack(_LIVE, len(tid), tid, len(manifest))
        self._mv[at + TRAILER.size : end] = manifest
        self._mv[at + 8 : at + TRAILER.size] = head[8:]
        self._mv[at : at + 8] = _LIVE

    def retire(self, at: int) -> None:
        """Clear the live marker of the trailer at ``at`` (the export is no longer pullable)."""
        self._mv[at : at + 8] = _DEAD

    def trailer(self, at: int, transfer_id: str) -> Trailer | None:
        """The trailer at ``at`` as it is now, if it is the live one of ``transfer_id``."""
        if at < HEADER_BYTES or at + TRAILER.size > self.size:
            return None
        head = bytes(self._mv[at : at + TRAILER.size])
        live, n, tid, mlen = TRAILER.unpack(head)
        end = at + TRAILER.size + mlen
        if live != _LIVE or tid[:n] != transfer_id.encode() or mlen > MAX_MANIFEST:
            return None
        if end > self.size:
            return None
        return Trailer(self, at, head, bytes(self._mv[at + TRAILER.size : end]))

    def address(self, offset: int = 0) -> int:
        """The virtual address of ``offset`` in this process (for RDMA memory registration)."""
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self._mm)) + offset

    def close(self) -> None:
        """Unmap (and, for the owner, unlink). Views handed out must have been released."""
        with contextlib.suppress(BufferError):
            self._mv.release()
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class Trailer:
    """A live export's trailer as read at one instant: its ``manifest``, and ``intact()``,
    which tells whether it still is (read it after copying the export's bytes: the owner
    retires the marker before the extent can change hands, and never reuses a transfer id)."""

    __slots__ = ("_at", "_head", "_region", "manifest")

    def __init__(self, region: StagingRegion, at: int, head: bytes, manifest: bytes) -> None:
        self._region, self._at, self._head, self.manifest = region, at, head, manifest

    def intact(self) -> bool:
        # the lock round trips order this read after the copy's on weakly ordered CPUs too
        for _ in range(2):
            with _FENCE:
                pass
        return bytes(self._region._mv[self._at : self._at + TRAILER.size]) == self._head


_FENCE = threading.Lock()


def _free_bytes(directory: Path) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize
