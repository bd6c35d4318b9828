"""KV as opaque named buffers: what a transfer moves, and where each buffer lies in it.

The sidecar never interprets KV. The engine's connector describes whatever its cache holds for a
request (V4: window rows, compressed entries per ratio, indexer keys, compressor state; V3: the
MLA latent) as named buffers with a dtype and a shape; the sidecar lays them out back to back in
one contiguous extent of its staging region and moves the extent's bytes. The decode side gets
the same names, dtypes, shapes and relative offsets back.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# bytes per element; names as torch spells them without the ``torch.`` prefix
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e8m0fnu": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
# buffer starts inside an extent: a multiple of every itemsize and of a cache line
BUFFER_ALIGN = 256
MAX_BUFFERS = 8192
MAX_DIMS = 8
# one transfer at most 64 GiB: far above any single request's KV, small enough to catch garbage
MAX_TRANSFER_BYTES = 64 << 30

_NAME = re.compile(r"^[A-Za-z0-9_.:/\-\[\]]{1,128}$")
_GROUP = re.compile(r"^[A-Za-z0-9_.:/\-]{0,64}$")


class LayoutError(ValueError):
    """A buffer description or a layout that cannot be right."""


def align_up(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """One named buffer: ``dtype`` elements in a C-contiguous ``shape``."""

    name: str
    """Unique within a transfer, e.g. ``layers.2.comp``."""
    dtype: str
    """A key of ``DTYPE_SIZES``."""
    shape: tuple[int, ...]
    """Dimensions; the buffer holds ``prod(shape)`` elements."""
    group: str = ""
    """Cache group, e.g. ``window``, ``comp4``, ``index``, ``comp_state``, ``latent``."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise LayoutError(
                f"buffer name {self.name!r} must be 1-128 characters of [A-Za-z0-9_.:/-[]]"
            )
        if self.dtype not in DTYPE_SIZES:
            raise LayoutError(
                f"buffer {self.name}: unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_SIZES)}"
            )
        if not isinstance(self.group, str) or not _GROUP.match(self.group):
            raise LayoutError(f"buffer {self.name}: bad group {self.group!r}")
        if len(self.shape) > MAX_DIMS:
            raise LayoutError(f"buffer {self.name}: {len(self.shape)} dims, at most {MAX_DIMS}")
        for d in self.shape:
            if not isinstance(d, int) or isinstance(d, bool) or d < 0:
                raise LayoutError(f"buffer {self.name}: shape {self.shape} has a bad dimension")
        if self.nbytes > MAX_TRANSFER_BYTES:
            raise LayoutError(f"buffer {self.name}: {self.nbytes} bytes is more than a transfer")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "group": self.group,
        }

    @classmethod
    def from_dict(cls, d: object) -> BufferSpec:
        if not isinstance(d, Mapping):
            raise LayoutError(f"a buffer must be an object, got {type(d).__name__}")
        shape = d.get("shape")
        if not isinstance(shape, list | tuple):
            raise LayoutError(f"buffer {d.get('name')!r}: shape must be a list of integers")
        return cls(
            name=d.get("name"),  # type: ignore[arg-type]  # validated in __post_init__
            dtype=d.get("dtype"),  # type: ignore[arg-type]
            shape=tuple(shape),
            group=d.get("group", ""),
        )


@dataclass(frozen=True, slots=True)
class PlacedBuffer:
    spec: BufferSpec
    offset: int
    """Bytes from the start of the transfer's extent."""

    def to_dict(self) -> dict[str, Any]:
        return {**self.spec.to_dict(), "offset": self.offset, "nbytes": self.spec.nbytes}


@dataclass(frozen=True, slots=True)
class Layout:
    """The buffers of one transfer, placed back to back (each start aligned) in one extent."""

    buffers: tuple[PlacedBuffer, ...]
    total_bytes: int

    @classmethod
    def plan(cls, specs: Iterable[BufferSpec], align: int = BUFFER_ALIGN) -> Layout:
        placed: list[PlacedBuffer] = []
        seen: set[str] = set()
        offset = 0
        for spec in specs:
            if spec.name in seen:
                raise LayoutError(f"buffer name {spec.name!r} appears twice")
            seen.add(spec.name)
            offset = align_up(offset, align)
            placed.append(PlacedBuffer(spec, offset))
            offset += spec.nbytes
        if not placed:
            raise LayoutError("a transfer needs at least one buffer")
        if len(placed) > MAX_BUFFERS:
            raise LayoutError(f"{len(placed)} buffers, at most {MAX_BUFFERS}")
        if offset > MAX_TRANSFER_BYTES:
            raise LayoutError(f"{offset} bytes in one transfer, at most {MAX_TRANSFER_BYTES}")
        return cls(tuple(placed), offset)

    def get(self, name: str) -> PlacedBuffer:
        for b in self.buffers:
            if b.spec.name == name:
                return b
        raise KeyError(name)

    def group_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.buffers:
            out[b.spec.group] = out.get(b.spec.group, 0) + b.spec.nbytes
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"total_bytes": self.total_bytes, "buffers": [b.to_dict() for b in self.buffers]}

    @classmethod
    def from_dict(cls, d: object) -> Layout:
        """Parse and check a layout received from a peer: every buffer inside the extent, no
        two overlapping, so a malicious or broken peer cannot make us write out of bounds."""
        if not isinstance(d, Mapping):
            raise LayoutError("a layout must be an object")
        total = d.get("total_bytes")
        raw = d.get("buffers")
        if not isinstance(total, int) or isinstance(total, bool) or total < 0:
            raise LayoutError("layout total_bytes must be a non-negative integer")
        if total > MAX_TRANSFER_BYTES:
            raise LayoutError(f"layout of {total} bytes, at most {MAX_TRANSFER_BYTES}")
        if not isinstance(raw, list) or not raw or len(raw) > MAX_BUFFERS:
            raise LayoutError(f"layout buffers must be a list of 1..{MAX_BUFFERS} buffers")
        placed: list[PlacedBuffer] = []
        for item in raw:
            spec = BufferSpec.from_dict(item)
            off = item.get("offset")
            if not isinstance(off, int) or isinstance(off, bool) or off < 0:
                raise LayoutError(f"buffer {spec.name}: offset must be a non-negative integer")
            placed.append(PlacedBuffer(spec, off))
        names = [p.spec.name for p in placed]
        if len(set(names)) != len(names):
            raise LayoutError("layout has duplicate buffer names")
        end = 0
        for p in sorted(placed, key=lambda p: p.offset):
            if p.offset < end:
                raise LayoutError(f"buffer {p.spec.name} overlaps the buffer before it")
            end = p.offset + p.spec.nbytes
        if end > total:
            raise LayoutError(f"buffers end at byte {end}, past the layout's {total} bytes")
        return cls(tuple(placed), total)


class LayoutCache:
    """Layouts parsed (and checked) from export trailers, by their manifest line: exports of one
    model with as many blocks look alike, so each shape is parsed once. Bounded: cleared when
    full. ``ValueError`` (``LayoutError`` is one) for a line that is not a layout."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._layouts: dict[bytes, Layout] = {}

    def __len__(self) -> int:
        return len(self._layouts)

    def get(self, raw: bytes) -> Layout:
        layout = self._layouts.get(raw)
        if layout is None:
            layout = Layout.from_dict(json.loads(raw))
            if len(self._layouts) >= self.capacity:
                self._layouts.clear()
            self._layouts[raw] = layout
        return layout
