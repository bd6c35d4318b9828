"""Load a checkpoint directory into one of our models.

safetensors, single file or sharded with ``model.safetensors.index.json``, read by several
threads straight to the target device, dequantised to the compute dtype; names may be
DeepSeek-native or transformers'. Every parameter must be filled and every checkpoint tensor
used (MTP copies of the shared embedding/head excepted): a mismatch is an error naming it.
A sharded model (tensor or expert parallel) takes its slice of each tensor (``ShardSpec``);
per-expert tensors of experts another rank holds are skipped by name, never read.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from dsv4_serving.layers.shard import ShardSpec, shard_specs
from dsv4_serving.loader.dummy import init_dummy_weights
from dsv4_serving.loader.names import convert, expert_of
from dsv4_serving.loader.quant import dequantize

LoadFormat = Literal["auto", "safetensors", "dummy"]
_SCALE_SUFFIXES = (".weight_scale_inv", ".scale")
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
) -> tuple[torch.Tensor | None, int | None]:
    """(this rank's part of ``t`` or None if it holds none, row of a stacked parameter)."""
    if spec is None:
        return t, expert
    if expert is None:
        return spec.narrow(t), None
    if spec.dim == 0:  # experts split over EP: a whole expert, or none
        return (t, expert - spec.start) if spec.holds(expert) else (None, None)
    return spec.narrow(t, dim_offset=-1), expert


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
    from safetensors import safe_open

    root = Path(path)
    names = _shards(root)
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    sample = next(iter(params.values()))
    device, dtype = sample.device, sample.dtype
    filled: dict[str, set[int] | None] = {}
    lock = threading.Lock()
    errors: list[str] = []
    scales = {s for n in names if (s := _scale_name(n, names))}
    specs = shard_specs(model)
    held = _held_experts(specs)

    def read(shard: str, keys: list[str]) -> None:
        handles: dict[str, object] = {}

        def get(name: str) -> torch.Tensor:
            f = names[name]
            if f not in handles:
                handles[f] = safe_open(str(root / f), framework="pt", device=str(device))
            return handles[f].get_tensor(name)  # type: ignore[attr-defined]

        for name in keys:
            if name in scales:
                continue
            e = expert_of(name)
            if e is not None and held is not None and not held.holds(e):
                continue  # another EP rank's expert
            t = get(name)
            sname = _scale_name(name, names)
            if sname is not None:
                t = dequantize(t, get(sname), dtype)
            pieces = convert(name, t, architecture, num_hidden_layers)
            if pieces is None:
                with lock:
                    errors.append(f"unexpected tensor {name}: no parameter of the model takes it")
                continue
            for piece in pieces:
                if _SHARED_COPIES.match(piece.param):
                    continue
                p = params.get(piece.param)
                if p is None:
                    with lock:
                        errors.append(f"unexpected tensor {name} (-> {piece.param})")
                    continue
                spec = specs.get(piece.param)
                part, row = _local(piece.tensor, piece.expert, spec)
                if part is None:
                    continue
                dst = p.data if row is None else p.data[row]
                if tuple(dst.shape) != tuple(part.shape):
                    with lock:
                        errors.append(
                            f"tensor {name}: shape {tuple(part.shape)}, "
                            f"{piece.param} expects {tuple(dst.shape)}"
                        )
                    continue
                with torch.no_grad():
                    dst.copy_(part.to(dst.dtype))
                with lock:
                    if row is None:
                        filled[piece.param] = None
                    else:
                        rows = filled.setdefault(piece.param, set())
                        if rows is not None:
                            rows.add(row)

    by_shard: dict[str, list[str]] = {}
    for n, f in names.items():
        by_shard.setdefault(f, []).append(n)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for fut in [pool.submit(read, f, keys) for f, keys in sorted(by_shard.items())]:
            fut.result()
    for pname, p in params.items():
        got = filled.get(pname, set())
        if got is None:
            continue
        want = p.shape[0] if pname.endswith(("experts.w1", "experts.w2", "experts.w3")) else 0
        if not got or (want and len(got) != want):
            missing = sorted(set(range(want)) - got) if want and got else None
            detail = f" (experts {missing[:8]} missing)" if missing else ""
            errors.append(f"missing tensor for parameter {pname}{detail}")
    if errors:
        raise WeightLoadError(
            f"{len(errors)} problem(s) loading {root}: " + "; ".join(sorted(errors)[:20])
        )
