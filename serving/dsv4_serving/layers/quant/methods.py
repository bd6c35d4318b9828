"""Quant methods: how a module creates a weight, which slice of its scale a rank holds, and how
it computes ``x @ W.t()`` with the weight kept in its stored format.

One seam for linears (``weight`` [O, I]) and stacked experts (``w1`` [E, O, I], one expert
at a time): ``create(module, name, shape)`` registers ``name`` and its scale ``name + "_scale"``
(and rewrites ``module.shards`` so scales shard with their weights), ``matmul(module, name, x,
index)`` computes. Formats (``docs/quantization.md``):

- ``Unquantized``: the compute dtype, ``F.linear``.
- ``Fp8Block``: e4m3 with a float32 scale per (bn x bk) block. On CPU (float32) one call of the
  C++ kernel (``kernels/fp8.cpp``: 4 rows dequantized at a time in cache, FMAs); else (and
  CUDA) a chunk of whole block rows at a time dequantized into one reusable scratch buffer
  (bounded extra memory), then matmul. Ascend 910 has no fp8 compute: fails fast.
- ``Fp4Experts``: e2m1 packed two per byte (element 2j in the low nibble), one e8m0 exponent
  per 32 inputs; same chunked dequantization.
- ``W8A8``: int8 with a float32 scale per output channel, activations quantized per token at
  run time (symmetric); on CPU one call of the C++ kernel (``kernels/w8a8.cpp``: quantization,
  int8 products and both scales, bitwise the torch path's result), else int8 x int8 -> int32 by
  ``torch._int_mm`` (CPU without a compiler, CUDA) or torch_npu's ``npu_quant_matmul`` (Ascend).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_serving.distributed.comm import all_gather
from dsv4_serving.distributed.groups import Group
from dsv4_serving.kernels.fp8 import Fp8Kernel
from dsv4_serving.kernels.w8a8 import W8A8Kernel
from dsv4_serving.layers.quant.scheme import NONE, QuantScheme
from dsv4_serving.layers.shard import ShardSpec
from dsv4_serving.loader.quant import (
    E2M1,
    quantize_fp4,
    quantize_fp8_block,
    quantize_int8_channel,
)

# fp32 elements one dequantized chunk may hold (16 MiB); a chunk is at least one block row
SCRATCH_ELEMS = 1 << 22
FP4_BLOCK = 32


class QuantError(ValueError):
    pass


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _register(module: nn.Module, name: str, t: torch.Tensor, quantized: bool) -> None:
    p = nn.Parameter(t, requires_grad=not quantized and t.is_floating_point())
    module.register_parameter(name, p)
    if quantized:  # stored format: never cast to the compute dtype
        kept: set[str] = getattr(module, "quant_params", set())
        kept.add(name)
        vars(module)["quant_params"] = kept


def _coarsen(spec: ShardSpec, block: int, what: str) -> ShardSpec:
    """The spec of a per-block tensor (scales, packed pairs) for a split of ``what``."""
    if spec.start % block or (spec.length % block and spec.start + spec.length != spec.full):
        raise QuantError(
            f"{what}: this rank's slice [{spec.start}, {spec.start + spec.length}) of "
            f"{spec.full} does not fall on {block}-wide quantization blocks; tensor-parallel "
            f"splits of quantized weights must be multiples of {block}"
        )
    return ShardSpec(
        spec.dim, spec.start // block, _cdiv(spec.length, block), _cdiv(spec.full, block)
    )


def _param(module: nn.Module, name: str) -> torch.Tensor:
    """``getattr(module, name)`` without nn.Module's slow attribute path for parameters."""
    p = module._parameters.get(name)
    return getattr(module, name) if p is None else p


def _weight(module: nn.Module, name: str, index: int | None) -> torch.Tensor:
    w: torch.Tensor = getattr(module, name)
    return w if index is None else w[index]


class QuantMethod:
    """Unquantized: the weight in the compute dtype."""

    format = "none"

    def create(self, module: nn.Module, name: str, shape: tuple[int, ...]) -> None:
        _register(module, name, torch.empty(shape), quantized=False)

    def matmul(
        self, module: nn.Module, name: str, x: torch.Tensor, index: int | None = None
    ) -> torch.Tensor:
        return F.linear(x, _weight(module, name, index))

    def dequantized(self, module: nn.Module, name: str, index: int | None = None) -> torch.Tensor:
        """The weight in float32 (the oracle's view, and layers that need the matrix itself)."""
        return _weight(module, name, index).float()

    def quantize(self, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """A logical float weight ([O, I] or stacked [E, O, I]) in this format: the tensors
        ``create`` registers, by name (dummy weights, tools)."""
        if w.dim() == 3:
            per = [self.quantize(name, e) for e in w]
            return {k: torch.stack([p[k] for p in per]) for k in per[0]}
        return self._quantize2d(name, w)

    def _quantize2d(self, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: w}

    def float_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        """The float weight's shape for a stored one (fp4 packs two inputs per byte)."""
        return stored


class _Chunked(QuantMethod):
    """Dequantize ``rows_per`` output rows at a time into a scratch buffer owned by the method
    (one per model: every layer's chunk reuses it), then ``x @ chunk.t()``."""

    row_block = 1

    def __init__(self) -> None:
        self._scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def _buffer(self, n: int, like: torch.Tensor) -> torch.Tensor:
        key = (like.device, like.dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, SCRATCH_ELEMS), dtype=like.dtype, device=like.device)
            self._scratch[key] = buf
        return buf[:n]

    def _rows_per(self, in_features: int) -> int:
        rb = self.row_block
        return max(rb, SCRATCH_ELEMS // max(in_features, 1) // rb * rb)

    def _dequant_rows(
        self, module: nn.Module, name: str, index: int | None, r0: int, r1: int, out: torch.Tensor
    ) -> None:
        raise NotImplementedError

    def _in_features(self, module: nn.Module, name: str) -> int:
        raise NotImplementedError

    def matmul(
        self, module: nn.Module, name: str, x: torch.Tensor, index: int | None = None
    ) -> torch.Tensor:
        if x.device.type == "npu":
            raise QuantError(
                f"{self.format} weights on Ascend: the 910 series has no fp8/fp4 compute; serve "
                "a W8A8 checkpoint (ModelSlim W8A8_DYNAMIC) or --quantization none"
            )
        w = _weight(module, name, index)
        out_f, in_f = int(w.shape[0]), self._in_features(module, name)
        flat = x.reshape(-1, in_f)
        step = self._rows_per(in_f)
        parts = []
        for r0 in range(0, out_f, step):
            r1 = min(out_f, r0 + step)
            buf = self._buffer((r1 - r0) * in_f, flat).view(r1 - r0, in_f)
            self._dequant_rows(module, name, index, r0, r1, buf)
            parts.append(flat @ buf.t())
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y.view(*x.shape[:-1], out_f)

    def dequantized(self, module: nn.Module, name: str, index: int | None = None) -> torch.Tensor:
        w = _weight(module, name, index)
        if index is None and w.dim() == 3:
            return torch.stack([self.dequantized(module, name, e) for e in range(w.shape[0])])
        out = torch.empty(int(w.shape[0]), self._in_features(module, name))
        self._dequant_rows(module, name, index, 0, out.shape[0], out)
        return out


class Fp8Block(_Chunked):
    format = "fp8"

    def __init__(self, block: tuple[int, int] = (128, 128), use_kernel: bool | None = None) -> None:
        """``use_kernel``: None uses the CPU kernel (float32) when it builds, False never."""
        super().__init__()
        self.kernel = Fp8Kernel(use_kernel)
        self.block = block
        self.row_block = block[0]
        self._tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def _table(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.device, like.dtype)
        t = self._tables.get(key)
        if t is None:
            every = torch.arange(256, dtype=torch.uint8, device=like.device)
            t = every.view(torch.float8_e4m3fn).to(like.dtype)
            self._tables[key] = t
        return t

    def create(self, module: nn.Module, name: str, shape: tuple[int, ...]) -> None:
        *lead, out_f, in_f = shape
        bn, bk = self.block
        _register(module, name, torch.empty(shape, dtype=torch.float8_e4m3fn), quantized=True)
        scale = torch.empty((*lead, _cdiv(out_f, bn), _cdiv(in_f, bk)), dtype=torch.float32)
        _register(module, name + "_scale", scale, quantized=True)
        shards: dict[str, ShardSpec] = getattr(module, "shards", {})
        spec = shards.get(name)
        if spec is not None:
            what = f"{type(module).__name__}.{name}"
            per_dim = {len(lead): bn, len(lead) + 1: bk}
            block = per_dim.get(spec.dim)
            shards[name + "_scale"] = spec if block is None else _coarsen(spec, block, what)

    def matmul(
        self, module: nn.Module, name: str, x: torch.Tensor, index: int | None = None
    ) -> torch.Tensor:
        ext = self.kernel.get(x)
        if ext is None:
            return super().matmul(module, name, x, index)
        w, s = _param(module, name), _param(module, name + "_scale")
        bn, bk = self.block
        y: torch.Tensor = ext.fp8_linear(x, w, s, bn, bk, -1 if index is None else index)
        return y

    def _in_features(self, module: nn.Module, name: str) -> int:
        return int(getattr(module, name).shape[-1])

    def _quantize2d(self, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, s = quantize_fp8_block(w, e8m0=False, block=self.block)
        return {name: q, name + "_scale": s}

    def _dequant_rows(
        self, module: nn.Module, name: str, index: int | None, r0: int, r1: int, out: torch.Tensor
    ) -> None:
        w = _weight(module, name, index)
        s = _weight(module, name + "_scale", index)
        bn, bk = self.block
        in_f = int(w.shape[1])
        # a 256-entry byte -> value table: ~2x faster than torch's fp8 cast on CPU, same values
        codes = w[r0:r1].view(torch.uint8).reshape(-1).int()
        torch.index_select(self._table(out), 0, codes, out=out.view(-1))
        for b in range(r0 // bn, _cdiv(r1, bn)):
            lo, hi = max(r0, b * bn) - r0, min(r1, (b + 1) * bn) - r0
            cols = s[b].repeat_interleave(bk)[:in_f].to(out.dtype)
            out[lo:hi].mul_(cols)


class Fp4Experts(_Chunked):
    format = "fp4"

    def __init__(self) -> None:
        super().__init__()
        self._pairs: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def create(self, module: nn.Module, name: str, shape: tuple[int, ...]) -> None:
        *lead, out_f, in_f = shape
        if in_f % FP4_BLOCK:
            raise QuantError(f"fp4 {name}: {in_f} inputs are not a multiple of {FP4_BLOCK}")
        packed = torch.empty((*lead, out_f, in_f // 2), dtype=torch.uint8)
        _register(module, name, packed, quantized=True)
        scale = torch.empty((*lead, out_f, in_f // FP4_BLOCK), dtype=torch.uint8)
        _register(module, name + "_scale", scale, quantized=True)
        shards: dict[str, ShardSpec] = getattr(module, "shards", {})
        spec = shards.get(name)
        if spec is not None and spec.dim == len(lead) + 1:  # split inputs: pairs and 32-blocks
            what = f"{type(module).__name__}.{name}"
            shards[name + "_scale"] = _coarsen(spec, FP4_BLOCK, what)
            shards[name] = _coarsen(spec, 2, what)
        elif spec is not None:
            shards[name + "_scale"] = spec

    def _in_features(self, module: nn.Module, name: str) -> int:
        return int(getattr(module, name).shape[-1]) * 2

    def float_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        return (*stored[:-1], stored[-1] * 2)

    def _quantize2d(self, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, s = quantize_fp4(w, FP4_BLOCK)
        return {name: packed.view(torch.uint8), name + "_scale": s}

    def _pair_table(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.device, like.dtype)
        t = self._pairs.get(key)
        if t is None:
            vals = E2M1.to(like.device, like.dtype)
            b = torch.arange(256, device=like.device)
            t = torch.stack((vals[b & 0xF], vals[b >> 4]), dim=-1)  # [256, 2]
            self._pairs[key] = t
        return t

    def _dequant_rows(
        self, module: nn.Module, name: str, index: int | None, r0: int, r1: int, out: torch.Tensor
    ) -> None:
        w = _weight(module, name, index)[r0:r1]
        s = _weight(module, name + "_scale", index)[r0:r1]
        pairs = self._pair_table(out)
        torch.index_select(pairs, 0, w.reshape(-1).int(), out=out.view(-1, 2))
        exp = torch.exp2(s.to(out.dtype) - 127.0)
        out.view(r1 - r0, -1, FP4_BLOCK).mul_(exp.unsqueeze(-1))


class W8A8(QuantMethod):
    format = "w8a8"

    def __init__(self, use_kernel: bool | None = None) -> None:
        """``use_kernel``: None picks the CPU kernel when it builds, False never (the oracle)."""
        self.kernel = W8A8Kernel(use_kernel)

    def create(self, module: nn.Module, name: str, shape: tuple[int, ...]) -> None:
        *lead, out_f, _ = shape
        _register(module, name, torch.empty(shape, dtype=torch.int8), quantized=True)
        scale = torch.empty((*lead, out_f), dtype=torch.float32)
        _register(module, name + "_scale", scale, quantized=True)
        shards: dict[str, ShardSpec] = getattr(module, "shards", {})
        spec = shards.get(name)
        if spec is not None and spec.dim <= len(lead):  # experts or output rows: scale follows
            shards[name + "_scale"] = spec

    def matmul(
        self, module: nn.Module, name: str, x: torch.Tensor, index: int | None = None
    ) -> torch.Tensor:
        ext = self.kernel.get(x)
        if ext is not None:  # one call: the Python around it costs as much as a small product
            group = _row_group(module, name)
            xs = None if group is None else token_scale(x.reshape(-1, x.shape[-1]), group)
            w, s = _param(module, name), _param(module, name + "_scale")
            y: torch.Tensor = ext.w8a8_linear(x, w, s, xs, -1 if index is None else index)
            return y
        w = _weight(module, name, index)
        s = _weight(module, name + "_scale", index)
        flat = x.reshape(-1, x.shape[-1])
        if x.device.type == "npu":
            y = _npu_quant_matmul(flat, w, s)
        else:
            xq, xs = quantize_per_token(flat, _input_split_group(module, name))
            y = (int8_mm(xq, w.t()).float() * xs * s).to(x.dtype)
        return y.view(*x.shape[:-1], w.shape[0])

    def dequantized(self, module: nn.Module, name: str, index: int | None = None) -> torch.Tensor:
        w = _weight(module, name, index)
        return w.float() * _weight(module, name + "_scale", index).unsqueeze(-1)

    def _quantize2d(self, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, s = quantize_int8_channel(w)
        return {name: q, name + "_scale": s}


def _input_split_group(module: nn.Module, name: str) -> Group | None:
    """The TP group a row-parallel linear splits its input over (None otherwise)."""
    spec = getattr(module, "shards", {}).get(name)
    group: Group | None = getattr(module, "group", None)
    w = getattr(module, name)
    if spec is None or group is None or group.size == 1 or spec.dim != w.dim() - 1:
        return None
    return group


def _row_group(module: nn.Module, name: str) -> Group | None:
    """``_input_split_group``, worked out once per module and weight."""
    known: dict[str, Group | None] = vars(module).setdefault("_row_groups", {})
    if name not in known:
        known[name] = _input_split_group(module, name)
    return known[name]


def quantize_per_token(
    x: torch.Tensor, group: Group | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (``round(x / s)``, ``s`` [T, 1] float32), ``s = amax / 127``.
    With ``group`` (a row split over TP ranks) the amax is the whole row's, so the ranks'
    int32 partial sums add up to the single-process product (one all-gather of T floats)."""
    xf = x.float()
    s = token_scale(xf, group)
    return (xf / s).round_().clamp_(-127, 127).to(torch.int8), s


def token_scale(x: torch.Tensor, group: Group | None = None) -> torch.Tensor:
    """``amax / 127`` per row [T, 1] float32 (the whole row's under a TP ``group``)."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    if group is not None:
        amax = all_gather(amax, group, dim=-1).amax(dim=-1, keepdim=True)
    return amax.clamp(min=1e-8) / 127.0


def int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] x int8 [K, N] -> int32. CUDA's kernel wants M > 16 (rows padded here)."""
    if a.device.type == "cuda" and a.shape[0] <= 16:
        pad = a.new_zeros((17, a.shape[1]))
        pad[: a.shape[0]] = a
        return torch._int_mm(pad, b)[: a.shape[0]]
    return torch._int_mm(a, b)


def _npu_quant_matmul(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """vllm-ascend's W8A8_DYNAMIC apply: per-token dynamic quant, then the fused int8 matmul
    with both scales applied in the epilogue."""
    try:
        import torch_npu
    except ImportError as exc:  # pragma: no cover - Ascend only
        raise QuantError("W8A8 on an npu device needs torch_npu") from exc
    xq, xs = torch_npu.npu_dynamic_quant(x)
    y: torch.Tensor = torch_npu.npu_quant_matmul(
        xq, w.t(), s, pertoken_scale=xs, output_dtype=x.dtype
    )
    return y


@dataclass(frozen=True)
class QuantMethods:
    """One model's methods: every layer shares them (and their scratch buffers)."""

    scheme: QuantScheme = NONE
    linear: QuantMethod = field(default_factory=QuantMethod)
    experts: QuantMethod = field(default_factory=QuantMethod)
    plain: QuantMethod = field(default_factory=QuantMethod)  # layers the formats keep in float


def methods_for(scheme: QuantScheme) -> QuantMethods:
    def make(fmt: str) -> QuantMethod:
        if fmt == "fp8":
            return Fp8Block(scheme.block)
        if fmt == "fp4":
            return Fp4Experts()
        if fmt == "w8a8":
            return W8A8()
        return QuantMethod()

    linear = make(scheme.linear)
    experts = linear if scheme.experts == scheme.linear else make(scheme.experts)
    return QuantMethods(scheme, linear, experts, QuantMethod())


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model.to(dtype)`` that leaves quantized weights and their scales as stored."""
    for module in model.modules():
        kept: set[str] = getattr(module, "quant_params", set())
        for name, p in module.named_parameters(recurse=False):
            if name not in kept and p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        for name, b in module.named_buffers(recurse=False):
            if b.is_floating_point() and b.dtype != dtype:
                module._buffers[name] = b.to(dtype)
    return model
