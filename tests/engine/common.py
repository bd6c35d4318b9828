"""Shared pieces of the engine tier: workloads, running an in-process core to completion,
starting ``dsv4 engine`` processes."""

from __future__ import annotations

import random
from pathlib import Path

from dsv4_common.process import Service, dsv4_argv, free_port
from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.engine.engine_core import EngineCore
from dsv4_serving.engine.request import EngineCoreRequest
from dsv4_serving.engine.sample.sampling_params import SamplingParams


def workload(n: int, seed: int, shared_prefix: int = 0) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs of mixed lengths: short prompts, long ones past the 128-token
    window, and optionally a common prefix (a "system prompt") of ``shared_prefix`` tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(shared_prefix)]
    out = []
    for i in range(n):
        length = rng.choice((3, 9, 17, 40, 70, 150, 190)) + rng.randrange(5)
        prompt = prefix + [rng.randrange(256) for _ in range(length)]
        out.append((prompt, 3 + (i * 5) % 11))
    return out


# A correct core emits a token at least every few dozen steps (the longest wait is a batch of
# chunked prefills, recomputed after a preemption); this many steps without one is a livelock.
# Counting steps, not seconds, keeps the check independent of how busy the machine is.
STALL_STEPS = 5000


def run(
    core: EngineCore,
    work: list[tuple[list[int], int]],
    waves: int = 1,
    stall_steps: int = STALL_STEPS,
) -> dict[int, list[int]]:
    """Greedy, ignore_eos; requests arrive in ``waves`` (each after the previous finished).
    Fails when ``stall_steps`` steps in a row produce no token."""
    got: dict[int, list[int]] = {}
    per = -(-len(work) // waves)
    for w in range(waves):
        for i in range(w * per, min(len(work), (w + 1) * per)):
            prompt, mt = work[i]
            sp = SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True)
            core.add_request(EngineCoreRequest(str(i), prompt, sp))
            got[i] = []
        idle = 0
        while core.has_unfinished_requests():
            assert idle < stall_steps, f"no token in {stall_steps} engine steps: a livelock"
            idle += 1
            for o in core.step():
                if o.new_token_ids:
                    idle = 0
                got[int(o.request_id)].extend(o.new_token_ids)
    return got


def alone(config: EngineConfig, work: list[tuple[list[int], int]]) -> dict[int, list[int]]:
    """Each request on its own: one sequence at a time, no prefix cache, no drafts."""
    core = EngineCore(config)
    out: dict[int, list[int]] = {}
    for i, item in enumerate(work):
        out[i] = run(core, [item])[0]
    return out


def start_engine(name: str, log_dir: Path, *args: str) -> Service:
    """``dsv4 engine *args`` on a free port of 127.0.0.1, started (``wait_ready`` next)."""
    port = free_port()
    argv = dsv4_argv("engine", "--host", "127.0.0.1", "--port", str(port), *args)
    server = Service(name, argv, log_dir / f"engine-{name}.log", f"http://127.0.0.1:{port}")
    server.start(env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    return server


def pass_through_checkpoint(path: Path) -> None:
    """A dsv4-tiny checkpoint whose next token depends only on the current one (attention and
    FFN outputs zeroed, so every block passes its streams through) and whose MTP layer
    computes the same function: its drafts are (nearly) always right."""
    import torch
    from safetensors.torch import save_file

    from dsv4_serving.loader.dummy import init_dummy_weights
    from dsv4_serving.models.registry import REGISTRY
    from dsv4_serving.presets import preset_config, write_preset

    write_preset("dsv4-tiny", path)
    cfg = preset_config("dsv4-tiny")
    cls = REGISTRY.resolve(cfg["architectures"][0])
    model = cls(cls.config_class.from_dict(cfg))
    init_dummy_weights(model, seed=3)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for k in sd:
        if k.endswith(("attn.wo_b.weight", "ffn.experts.w2", "shared_experts.w2.weight")):
            sd[k].zero_()
    sd["mtp.0.e_proj.weight"] = torch.eye(cfg["hidden_size"])
    sd["mtp.0.h_proj.weight"].zero_()
    sd["mtp.0.enorm.weight"].fill_(1.0)
    sd["mtp.0.norm.weight"] = sd["norm.weight"].clone()
    save_file(sd, str(path / "model.safetensors"))
