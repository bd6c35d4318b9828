"""``load_format=dummy``: deterministic random weights from a seed, no files.

Scales keep activations and logits of order one at any size, so tiny random models produce
varied tokens (a useful test signal) rather than a flat distribution. A sharded parameter is
generated in its logical (single-process) shape and then sliced, so every parallel layout
holds exactly the single-process values.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from dsv4_serving.layers.quant.methods import QuantMethod
from dsv4_serving.layers.shard import ShardSpec, shard_specs


def _generator(seed: int, name: str) -> torch.Generator:
    # per-tensor streams: a parameter's values do not depend on which others exist
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    specs = shard_specs(model)
    quantized = _quantized(model)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            g = _generator(seed, name)
            spec = specs.get(name)
            leaf = name.rsplit(".", 1)[-1]
            if name in quantized:
                _fill_quantized(model, name, p, spec, g, specs)
                continue
            if name.endswith("_scale") and name[: -len("_scale")] in quantized:
                continue  # filled with its weight
            if name.endswith("tid2eid"):
                vocab, k = p.shape
                n_exp = _num_experts(model, name)
                rows = [torch.randperm(n_exp, generator=g)[:k] for _ in range(vocab)]
                p.copy_(torch.stack(rows).to(p.dtype))
                continue
            if not p.is_floating_point():
                continue
            shape = p.shape if spec is None else spec.logical_shape(p.shape)
            if leaf == "weight" and (name.endswith("norm.weight") or p.dim() == 1):
                v = 1.0 + 0.1 * torch.randn(shape, generator=g)
            elif name.endswith("embed.weight"):
                v = torch.randn(shape, generator=g)
            elif leaf in ("attn_sink", "ape") or leaf.endswith("_base"):
                v = 0.5 * torch.randn(shape, generator=g)
            elif leaf.endswith("_scale"):
                v = 1.0 + 0.1 * torch.randn(shape, generator=g)
            elif leaf == "bias":
                v = 0.1 * torch.randn(shape, generator=g)
            else:
                v = torch.randn(shape, generator=g) * shape[-1] ** -0.5
            p.copy_((v if spec is None else spec.narrow(v)).to(p.dtype))


def _num_experts(model: nn.Module, tid2eid_name: str) -> int:
    gate = model.get_submodule(tid2eid_name.rsplit(".", 1)[0])
    return int(gate.weight.shape[0])  # the router is replicated: every expert


def _quantized(model: nn.Module) -> set[str]:
    """Names of the quantized weights (not their scales)."""
    out: set[str] = set()
    for prefix, module in model.named_modules():
        for local in getattr(module, "quant_params", ()):
            if not local.endswith("_scale"):
                out.add(f"{prefix}.{local}" if prefix else local)
    return out


def _fill_quantized(
    model: nn.Module,
    name: str,
    p: torch.Tensor,
    spec: ShardSpec | None,
    g: torch.Generator,
    specs: dict[str, ShardSpec],
) -> None:
    """The float weight the unquantized model would get, quantized whole (so every parallel
    layout holds the single-process values), then this rank's slice of each stored tensor."""
    prefix, leaf = name.rsplit(".", 1) if "." in name else ("", name)
    module = model.get_submodule(prefix)
    method: QuantMethod = getattr(module, "quant")  # noqa: B009 - typed here
    stored = tuple(p.shape) if spec is None else spec.logical_shape(p.shape)
    shape = method.float_shape(stored)
    v = torch.randn(shape, generator=g) * shape[-1] ** -0.5
    for local, t in method.quantize(leaf, v).items():
        full = f"{prefix}.{local}" if prefix else local
        s = specs.get(full)
        dst = module.get_parameter(local)
        dst.copy_((t if s is None else s.narrow(t)).view(dst.dtype).to(dst.device))
