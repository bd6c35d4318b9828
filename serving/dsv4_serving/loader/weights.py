"""Load a checkpoint directory into one of our models.

safetensors, single file or sharded with ``model.safetensors.index.json``, read by several
threads straight to the target device; names may be DeepSeek-native or transformers'. A
quantized tensor (with its scale: ``weight_scale_inv`` / ``scale`` / ModelSlim's
``weight_scale`` + ``weight_offset``) is stored as is when the model holds that weight
quantized (``layers/quant``), else dequantised to the compute dtype (``--quantization none``,
the oracle). Every parameter must be filled and every checkpoint tensor
used (MTP copies of the shared embedding/head excepted): a mismatch is an error naming it.
A sharded model (tensor or expert parallel) takes its slice of each tensor (``ShardSpec``);
per-expert tensors of experts another rank holds are skipped by name, never read; with EPLB
an expert fills every slot of this rank that holds it (its replicas).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from dsv4_serving.layers.shard import ShardSpec, shard_specs
from dsv4_serving.loader.dummy import init_dummy_weights
from dsv4_serving.loader.names import Piece, convert, expert_of
from dsv4_serving.loader.quant import dequantize, e8m0_to_float, int8_channel_scale

LoadFormat = Literal["auto", "safetensors", "dummy"]
# DeepSeek V3 (float32), DeepSeek V4 (e8m0), ModelSlim W8A8 (per channel, with weight_offset)
_SCALE_SUFFIXES = (".weight_scale_inv", ".scale", ".weight_scale")
_OFFSET_SUFFIX = ".weight_offset"
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the HF-hosted V3 checkpoints repeat embed/head inside each MTP layer
_SHARED_COPIES = re.compile(r"^mtp\.\d+\.(embed|head)\.weight$")


class WeightLoadError(RuntimeError):
    pass


def _shards(path: Path) -> dict[str, str]:
    """tensor name -> shard file name."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {path} (use load_format=dummy?)")
    out: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            out.update(dict.fromkeys(h.keys(), f.name))
    return out


def _scale_name(name: str, names: dict[str, str]) -> str | None:
    if not name.endswith(".weight"):
        return None
    stem = name[: -len(".weight")]
    for suffix in _SCALE_SUFFIXES:
        if stem + suffix in names:
            return stem + suffix
    return None


def _held_experts(specs: dict[str, ShardSpec]) -> ShardSpec | None:
    """The block of experts this rank holds (the same in every layer), None if all."""
    return next((s for n, s in specs.items() if n.endswith("experts.w1") and s.dim == 0), None)


def _local(
    t: torch.Tensor, expert: int | None, spec: ShardSpec | None
) -> tuple[torch.Tensor | None, list[int] | None]:
    """(this rank's part of ``t`` or None if it holds none, rows of a stacked parameter: one
    per slot holding the expert, several for EPLB's replicas)."""
    if spec is None:
        return t, None if expert is None else [expert]
    if expert is None:
        return spec.narrow(t), None
    if spec.dim == 0:  # experts split over EP: whole experts, or none
        rows = spec.local_rows(expert)
        return (t, rows) if rows else (None, None)
    return spec.narrow(t, dim_offset=-1), [expert]


def _checkpoint_block(root: Path) -> tuple[int, int]:
    """The fp8 scale block the checkpoint declares (its config.json), 128x128 by default."""
    cfg = root / "config.json"
    if cfg.is_file():
        qc = json.loads(cfg.read_text()).get("quantization_config") or {}
        bs = qc.get("weight_block_size") or (128, 128)
        return int(bs[0]), int(bs[1])
    return (128, 128)


def _stored(
    p: torch.Tensor,
    raw: torch.Tensor,
    scale: torch.Tensor,
    suffix: str,
    offset: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scale) in the format the model holds ``p`` in; ValueError on a mismatch."""
    fp4_dtype = getattr(torch, "float4_e2m1fn_x2", None)
    if (
        p.dtype == torch.float8_e4m3fn
        and raw.dtype == torch.float8_e4m3fn
        and suffix != ".weight_scale"
    ):
        return raw, scale if scale.dtype == torch.float32 else e8m0_to_float(scale)
    if (
        p.dtype == torch.uint8
        and raw.dtype in (torch.int8, torch.uint8, fp4_dtype)
        and suffix == ".scale"
    ):
        e8m0 = scale.view(torch.uint8) if scale.dtype != torch.float32 else None
        if e8m0 is None:
            raise ValueError("fp4 scales must be e8m0 (uint8 exponents), got float32")
        return raw.view(torch.uint8), e8m0
    if p.dtype == torch.int8 and raw.dtype == torch.int8 and suffix == ".weight_scale":
        return raw, int8_channel_scale(scale, offset, "int8 weight")
    held = {torch.float8_e4m3fn: "fp8", torch.uint8: "fp4 (packed)", torch.int8: "w8a8 int8"}
    raise ValueError(
        f"the model holds it as {held.get(p.dtype, str(p.dtype))} but the checkpoint stores "
        f"{raw.dtype} with a {suffix.lstrip('.')} scale (a different quantization: check "
        "--quantization against the checkpoint)"
    )


def load_weights(
    model: nn.Module,
    path: str | Path,
    architecture: str,
    num_hidden_layers: int,
    load_format: LoadFormat = "auto",
    seed: int = 0,
    threads: int = 4,
) -> None:
    """Fill ``model``'s parameters (already on the target device and dtype)."""
    if load_format == "dummy":
        init_dummy_weights(model, seed)
        return
    WeightLoader(model, Path(path), architecture, num_hidden_layers).load(threads)


@dataclass(frozen=True, slots=True)
class _Scale:
    """A quantized checkpoint tensor's scale: its suffix, its pieces (split as the weight is)
    and ModelSlim's offset."""

    suffix: str
    pieces: list[Piece]
    offset: torch.Tensor | None


class WeightLoader:
    """One checkpoint read into ``model`` by several threads, one shard file each: what they
    share (the parameters each fills, the problems found) is updated under one lock."""

    def __init__(
        self, model: nn.Module, root: Path, architecture: str, num_hidden_layers: int
    ) -> None:
        self.root, self.architecture, self.num_hidden_layers = root, architecture, num_hidden_layers
        self.names = _shards(root)
        self.params = dict(model.named_parameters()) | dict(model.named_buffers())
        sample = next(p for p in self.params.values() if p.dtype in _FLOAT_DTYPES)
        self.device, self.dtype = sample.device, sample.dtype
        self.block = _checkpoint_block(root)
        self.quantized = {
            f"{prefix}.{n}" if prefix else n
            for prefix, module in model.named_modules()
            for n in getattr(module, "quant_params", ())
            if not n.endswith("_scale")
        }
        self.scales = {s for n in self.names if (s := _scale_name(n, self.names))}
        self.offsets = {n for n in self.names if n.endswith(_OFFSET_SUFFIX)}
        self.specs = shard_specs(model)
        self.held = _held_experts(self.specs)
        # param -> None (filled whole) or the rows of a stacked parameter filled so far
        self.filled: dict[str, set[int] | None] = {}
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def load(self, threads: int) -> None:
        """Read every shard, then check every parameter was filled; raise naming what is wrong."""
        by_shard: dict[str, list[str]] = {}
        for n, f in self.names.items():
            by_shard.setdefault(f, []).append(n)
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            for fut in [pool.submit(self.read, keys) for _, keys in sorted(by_shard.items())]:
                fut.result()
        self._check_filled()
        if self.errors:
            raise WeightLoadError(
                f"{len(self.errors)} problem(s) loading {self.root}: "
                + "; ".join(sorted(self.errors)[:20])
            )

    def _error(self, message: str) -> None:
        with self.lock:
            self.errors.append(message)

    def read(self, keys: list[str]) -> None:
        """One thread's share: the tensors ``keys`` (of one shard), through handles it owns."""
        from safetensors import safe_open

        handles: dict[str, object] = {}

        def get(name: str) -> torch.Tensor:
            f = self.names[name]
            if f not in handles:
                handles[f] = safe_open(str(self.root / f), framework="pt", device=str(self.device))
            return handles[f].get_tensor(name)  # type: ignore[attr-defined,no-any-return]

        for name in keys:
            self._read_tensor(name, get)

    def _read_tensor(self, name: str, get: Callable[[str], torch.Tensor]) -> None:
        if name in self.scales or name in self.offsets:
            return
        e = expert_of(name)
        if e is not None and self.held is not None and not self.held.holds(e):
            return  # another EP rank's expert
        t = get(name)
        sname = _scale_name(name, self.names)
        pieces = convert(name, t, self.architecture, self.num_hidden_layers)
        if pieces is None:
            self._error(f"unexpected tensor {name}: no parameter of the model takes it")
            return
        scale = None
        if sname is not None:
            oname = name[: -len(".weight")] + _OFFSET_SUFFIX
            # the scale splits (transformers' stacked gate_up) as its weight does
            scale = _Scale(
                sname[len(name) - len(".weight") :],
                convert(name, get(sname), self.architecture, self.num_hidden_layers) or [],
                get(oname) if oname in self.offsets else None,
            )
        for i, piece in enumerate(pieces):
            if _SHARED_COPIES.match(piece.param):
                continue
            if piece.param not in self.params:
                self._error(f"unexpected tensor {name} (-> {piece.param})")
            elif piece.param in self.quantized:
                self._place_quantized(name, t, piece, i, scale)
            else:
                self._place_dequantized(name, piece, i, scale)

    def _place_quantized(
        self, name: str, t: torch.Tensor, piece: Piece, i: int, scale: _Scale | None
    ) -> None:
        """A weight the model holds quantized: stored as is, with its scale."""
        try:
            if scale is None:
                raise ValueError(
                    f"the model holds it quantized but the checkpoint stores "
                    f"{t.dtype} without a scale"
                )
            w, sc = _stored(
                self.params[piece.param],
                piece.tensor,
                scale.pieces[i].tensor,
                scale.suffix,
                scale.offset,
            )
        except ValueError as exc:
            self._error(f"tensor {name} (-> {piece.param}): {exc}")
            return
        self.place(name, piece.param, w, piece.expert)
        self.place(name, piece.param + "_scale", sc, piece.expert)

    def _place_dequantized(self, name: str, piece: Piece, i: int, scale: _Scale | None) -> None:
        """A weight the model holds in the compute dtype: dequantized first if it has a scale."""
        value = piece.tensor
        if scale is not None:
            channel = scale.suffix == ".weight_scale"
            try:
                value = dequantize(
                    value,
                    int8_channel_scale(scale.pieces[i].tensor, scale.offset, name)
                    if channel
                    else scale.pieces[i].tensor,
                    self.dtype,
                    self.block,
                    int8_channel=channel,
                )
            except ValueError as exc:
                self._error(f"tensor {name}: {exc}")
                return
        self.place(name, piece.param, value, piece.expert)

    def place(self, name: str, param: str, tensor: torch.Tensor, expert: int | None) -> None:
        """Copy this rank's part of ``tensor`` into ``param`` (every slot holding ``expert``)."""
        p = self.params[param]
        part, rows = _local(tensor, expert, self.specs.get(param))
        if part is None:
            return
        for row in rows if rows else [None]:
            dst = p.data if row is None else p.data[row]
            if tuple(dst.shape) != tuple(part.shape):
                self._error(
                    f"tensor {name}: shape {tuple(part.shape)}, {param} expects {tuple(dst.shape)}"
                )
                return
            with torch.no_grad():
                dst.copy_(part.to(dst.dtype))
            with self.lock:
                if row is None:
                    self.filled[param] = None
                else:
                    got = self.filled.setdefault(param, set())
                    if got is not None:
                        got.add(row)

    def _check_filled(self) -> None:
        """Every parameter filled (a stacked expert parameter: every row)."""
        for pname, p in self.params.items():
            got = self.filled.get(pname, set())
            if got is None:
                continue
            stacked = ("experts.w1", "experts.w2", "experts.w3")
            want = p.shape[0] if pname.removesuffix("_scale").endswith(stacked) else 0
            if not got or (want and len(got) != want):
                missing = sorted(set(range(want)) - got) if want and got else None
                detail = f" (experts {missing[:8]} missing)" if missing else ""
                self.errors.append(f"missing tensor for parameter {pname}{detail}")
