"""Shared pieces of the engine tier: workloads, running an in-process core to completion,
starting ``dsv4 engine`` processes."""

from __future__ import annotations

import random
import time
from pathlib import Path

from dsv4_common.process import Service, dsv4_argv, free_port
from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.engine_core import EngineCore
from dsv4_serving.engine.request import EngineCoreRequest
from dsv4_serving.engine.sampling_params import SamplingParams


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


def run(
    core: EngineCore,
    work: list[tuple[list[int], int]],
    waves: int = 1,
    timeout_s: float = 240.0,
) -> dict[int, list[int]]:
    """Greedy, ignore_eos; requests arrive in ``waves`` (each after the previous finished)."""
    got: dict[int, list[int]] = {}
    per = -(-len(work) // waves)
    deadline = time.monotonic() + timeout_s
    for w in range(waves):
        for i in range(w * per, min(len(work), (w + 1) * per)):
            prompt, mt = work[i]
            sp = SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True)
            core.add_request(EngineCoreRequest(str(i), prompt, sp))
            got[i] = []
        while core.has_unfinished_requests():
            assert time.monotonic() < deadline, "engine did not finish in time"
            for o in core.step():
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
