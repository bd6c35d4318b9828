"""Node-local collectives through one shared-memory segment per group (CPU ranks).

gloo over loopback TCP costs about 0.8 ms per collective however small the tensor, and a
dsv3-small step makes a dozen of them; here a collective is a copy into this member's slot, a
flag store, a wait for every member's flag and a read of every slot (vLLM's CPU ``shm``
all-reduce and ``ShmRingBuffer`` do the same in C++).

Layout: one 64-byte line per member (its operation counter, its pid), then two buffers of one
slot per member. Every member makes the same operations in the same order, so op ``n`` writes
buffer ``n % 2``: a member can only reach op ``n + 2`` (and overwrite that buffer) once every
member has arrived at ``n + 1``, that is, has finished reading op ``n``. Sums run over the slots
in member order on every member, so every member gets the same bits (for two members the same
bits as gloo's ``a + b``). Data larger than a slot goes in rounds.

Ordering relies on x86's store order (data stores are visible before the flag store that follows
them); on other CPUs ``shm_supported`` is False and the group keeps gloo.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

LINE = 64  # bytes per member's flag line (no false sharing between members' counters)
_Q = LINE // 8  # int64 stride between flags
SLOT_BYTES = 1 << 20
_LEN = struct.Struct("<q")
# after this long in one wait, check every 0.5 s that the peers still live
_LIVENESS_AFTER_S = 0.5
DISABLE_ENV = "DSV4_SHM_COMM"  # "0": every group keeps gloo (A/B figures, a suspected bug)


class ShmCommError(RuntimeError):
    pass


def shm_supported(directory: str = "/dev/shm") -> bool:
    return (
        os.environ.get(DISABLE_ENV, "1") != "0"
        and platform.machine().lower() in ("x86_64", "amd64")
        and os.path.isdir(directory)
    )


def segment_bytes(members: int, slot_bytes: int = SLOT_BYTES) -> int:
    return LINE * members + 2 * members * slot_bytes


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    # state is the field after the parenthesised command name; a zombie has exited
    return stat[stat.rfind(")") + 2] not in "ZXx"


class ShmChannel:
    """One member's mapping of its group's segment. ``ranks`` (global ranks) name peers in
    errors; ``timeout_s`` bounds a wait for a peer that neither arrives nor dies."""

    def __init__(
        self,
        mm: mmap.mmap,
        ranks: tuple[int, ...],
        index: int,
        timeout_s: float,
        slot_bytes: int = SLOT_BYTES,
    ) -> None:
        self.ranks = ranks
        self.index = index
        self.size = len(ranks)
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self._mm = mm
        self._flags = memoryview(mm).cast("q")
        self._bytes = memoryview(mm)
        self._data = torch.frombuffer(mm, dtype=torch.uint8)
        self._seq = 0
        self._flags[index * _Q] = 0
        self._flags[index * _Q + 1] = os.getpid()

    # --- setup -------------------------------------------------------------------------
    @staticmethod
    def create_file(
        members: int, directory: str = "/dev/shm", slot_bytes: int = SLOT_BYTES
    ) -> Path:
        """A new zero-filled segment file (the group's member 0 makes it; everyone maps it, then
        it is unlinked, so a killed instance leaves nothing in /dev/shm)."""
        path = Path(directory) / f"dsv4-comm-{secrets.token_hex(8)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, segment_bytes(members, slot_bytes))
        except OSError as e:
            os.close(fd)
            path.unlink()
            raise ShmCommError(f"cannot size {path}: {e.strerror}") from None
        os.close(fd)
        return path

    @classmethod
    def attach(
        cls,
        path: Path,
        ranks: tuple[int, ...],
        index: int,
        timeout_s: float,
        slot_bytes: int = SLOT_BYTES,
    ) -> ShmChannel:
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, segment_bytes(len(ranks), slot_bytes), mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return cls(mm, ranks, index, timeout_s, slot_bytes)

    def close(self) -> None:
        # the tensor and memoryviews over the map must go before the map can close
        del self._data
        self._flags.release()
        self._bytes.release()
        # a view someone still holds keeps the map alive; it goes with that view
        with contextlib.suppress(BufferError):
            self._mm.close()

    # --- the protocol ------------------------------------------------------------------
    def _slot(self, member: int, seq: int) -> int:
        return LINE * self.size + ((seq % 2) * self.size + member) * self.slot_bytes

    def _arrive(self) -> int:
        self._seq += 1
        return self._seq

    def _publish_and_wait(self, seq: int) -> None:
        self._flags[self.index * _Q] = seq
        flags, q, n = self._flags, _Q, self.size
        start = time.monotonic()
        check_at = start + _LIVENESS_AFTER_S
        spins = 0
        while True:
            if all(flags[j * q] >= seq for j in range(n)):
                return
            spins += 1
            # yield the core first (ranks may share cores with each other and the front
            # end), then sleep: an idle follower waits here between steps
            if spins < 2000:
                os.sched_yield()
                continue
            time.sleep(0.0002 if spins < 4000 else 0.001)
            now = time.monotonic()
            if now >= check_at:
                self._check_peers(seq, now - start)
                check_at = now + _LIVENESS_AFTER_S

    def _check_peers(self, seq: int, waited: float) -> None:
        late = [j for j in range(self.size) if self._flags[j * _Q] < seq]
        for j in late:
            pid = self._flags[j * _Q + 1]
            if pid and not _alive(pid):
                raise ShmCommError(
                    f"rank {self.ranks[j]} (pid {pid}) exited during a collective "
                    f"(op {seq} of group {list(self.ranks)})"
                )
        if waited > self.timeout_s:
            names = ", ".join(str(self.ranks[j]) for j in late)
            raise ShmCommError(
                f"collective timed out after {waited:.0f} s: rank {names} of group "
                f"{list(self.ranks)} never arrived (op {seq})"
            )

    def _view(self, member: int, seq: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        start = self._slot(member, seq)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self._data[start : start + nbytes].view(dtype)

    def _rounds(
        self, flat: torch.Tensor, send: bool = True
    ) -> Iterator[tuple[int, torch.Tensor, list[torch.Tensor]]]:
        """Slot-sized pieces of ``flat``: each round copies this member's piece into its slot
        (when ``send``), waits for every member and yields (offset, piece, every member's
        slot view of it)."""
        per = self.slot_bytes // flat.element_size()
        for a in range(0, max(1, flat.numel()), per):
            piece = flat[a : a + per]
            seq = self._arrive()
            views = [self._view(j, seq, piece.dtype, piece.numel()) for j in range(self.size)]
            if send:
                views[self.index].copy_(piece)
            self._publish_and_wait(seq)
            yield a, piece, views

    @staticmethod
    def _in_place(x: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """``fn`` on a flat contiguous view of ``x``, written back into ``x`` (returned)."""
        work = x if x.is_contiguous() else x.contiguous()
        fn(work.view(-1))
        if work is not x:
            x.copy_(work)
        return x

    # --- collectives -------------------------------------------------------------------
    @torch.no_grad()  # a collective is not differentiable (as gloo's)
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the members, in place on ``x`` (returned)."""

        def run(flat: torch.Tensor) -> None:
            for _, piece, views in self._rounds(flat):
                torch.add(views[0], views[1], out=piece)
                for v in views[2:]:
                    piece.add_(v)

        return self._in_place(x, run)

    @torch.no_grad()
    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every member's ``x`` (equal shapes) concatenated along ``dim`` in member order."""
        flat = x.contiguous().view(-1)
        out = flat.new_empty((self.size, flat.numel()))
        for a, piece, views in self._rounds(flat):
            for j, v in enumerate(views):
                out[j, a : a + piece.numel()] = v
        return torch.cat([out[j].view(x.shape) for j in range(self.size)], dim=dim)

    @torch.no_grad()
    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Member ``src``'s ``x`` on every member, in place (returned)."""

        def run(flat: torch.Tensor) -> None:
            for _, piece, views in self._rounds(flat, send=self.index == src):
                if self.index != src:
                    piece.copy_(views[src])

        return self._in_place(x, run)

    def exchange(self, data: bytes) -> list[bytes]:
        """Every member's bytes, in member order (a member with nothing to say sends b"")."""
        cap = self.slot_bytes - _LEN.size
        seq = self._arrive()
        mine = self._slot(self.index, seq)
        _LEN.pack_into(self._bytes, mine, len(data))
        first = data[:cap]
        self._bytes[mine + _LEN.size : mine + _LEN.size + len(first)] = first
        self._publish_and_wait(seq)
        lengths = [_LEN.unpack_from(self._bytes, self._slot(j, seq))[0] for j in range(self.size)]
        parts: list[list[bytes]] = []
        for j, n in enumerate(lengths):
            s = self._slot(j, seq) + _LEN.size
            parts.append([bytes(self._bytes[s : s + min(n, cap)])])
        rounds = max(-(-n // cap) for n in lengths) if any(lengths) else 1
        for r in range(1, rounds):
            seq = self._arrive()
            chunk = data[r * cap : (r + 1) * cap]
            s = self._slot(self.index, seq)
            self._bytes[s : s + len(chunk)] = chunk
            self._publish_and_wait(seq)
            for j, n in enumerate(lengths):
                left = n - r * cap
                if left > 0:
                    s = self._slot(j, seq)
                    parts[j].append(bytes(self._bytes[s : s + min(left, cap)]))
        return [b"".join(p) for p in parts]


def open_channel(
    ranks: tuple[int, ...], index: int, cpu_group: Any, timeout_s: float
) -> ShmChannel | None:
    """The group's channel, made over its gloo CPU group (every member calls this); None on
    every member when any member cannot map it (the group keeps gloo)."""
    import logging

    import torch.distributed as dist

    log = logging.getLogger(__name__)
    box: list[Any] = [None]
    if index == 0 and shm_supported():
        try:
            box[0] = str(ShmChannel.create_file(len(ranks)))
        except (OSError, ShmCommError) as e:
            log.warning("shared-memory collectives off for group %s: %s", list(ranks), e)
    dist.broadcast_object_list(box, src=ranks[0], group=cpu_group)
    path = box[0]
    channel: ShmChannel | None = None
    if path is not None:
        try:
            channel = ShmChannel.attach(Path(path), ranks, index, timeout_s)
        except OSError as e:
            log.warning("rank %d cannot map %s: %s", ranks[index], path, e)
    ok: list[Any] = [None] * len(ranks)
    dist.all_gather_object(ok, channel is not None, group=cpu_group)
    if index == 0 and path is not None:
        Path(path).unlink(missing_ok=True)
    if all(ok):
        return channel
    if channel is not None:
        channel.close()
    return None
