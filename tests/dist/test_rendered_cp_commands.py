"""The operator's rendered CP 2 CPU prefill pod (``parallelism: {cp: 2}``: one pod, two rank
processes, ``--context-parallel-size 2``) and a TP 1 decode pod, run as processes on 127.0.0.1
as in ``test_rendered_commands.py`` (same substitutions), serve a single-process engine's greedy
tokens through the gateway: the prefill splits each prompt over its CP ranks, CP rank 0 exports
the (replicated) cache and the decode pulls it."""

from __future__ import annotations

import copy
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsv4_common.process import Service, free_port
from dsv4_operator.api.spec import DeploymentSpec, parse
from dsv4_operator.reconcile import names
from tests.engine.common import workload

from .processes import greedy_tokens
from .test_rendered_commands import (
    CR,
    _flag,
    _objects,
    _ports,
    _rank_processes,
    _run,
    _start_pods,
    _without,
)

pytestmark = pytest.mark.dist

ITEMS = workload(5, 9, shared_prefix=16)  # 20-215 tokens: 2 to 14 blocks of 16


def _cr() -> dict[str, Any]:
    cr = copy.deepcopy(CR)
    cr["spec"]["prefill"].update(parallelism={"cp": 2, "tp": 1}, mtpTokens=0)
    decode = cr["spec"]["decode"]
    decode.update(nodesPerInstance=1, parallelism={"tp": 1}, mtpTokens=0)
    return cr


def _gateway(
    objs: dict[tuple[str, str], dict[str, Any]],
    spec: DeploymentSpec,
    prefill: str,
    decode: str,
    tmp: Path,
) -> Service:
    pod = objs[("Deployment", names.gateway_name(spec))]["spec"]["template"]["spec"]
    gw = pod["containers"][0]
    port = free_port()
    argv = _without(
        gw["command"], "--discovery", "--namespace", "--selector", "--routing-configmap"
    )
    argv = _ports(argv, {names.GATEWAY_PORT: port})
    argv += ["--discovery", "static", "--prefill", prefill, "--decode", decode]
    return _run(argv, "gateway", tmp / "gateway.log", f"http://127.0.0.1:{port}", {}, "/ready")


def test_rendered_cp2_prefill_pod_serves_the_single_process_tokens(tmp_path: Path) -> None:
    spec = parse(_cr())
    objs = _objects(spec)
    cmd = objs[("StatefulSet", "tiny-prefill-0")]["spec"]["template"]["spec"]["containers"][0][
        "command"
    ]
    assert _flag(cmd, "--context-parallel-size") == "2"
    assert _flag(cmd, "--tensor-parallel-size") == "1"
    assert _flag(cmd, "--threads-per-rank") == "1"  # 2 CPUs over its 2 ranks
    everything: list[Service] = []
    try:
        pods = _start_pods(spec, objs, tmp_path, set())
        everything += [s for ps in pods.values() for p in ps for s in p.services]
        config = json.loads(objs[("ConfigMap", "tiny-engine")]["data"]["engine.json"])
        ref_conf = tmp_path / "ref.engine.json"
        ref_conf.write_text(
            json.dumps({k: v for k, v in config.items() if not k.startswith("kv_")})
        )
        ref_port = free_port()
        ref = _run(
            [
                *("dsv4", "engine", "--config", str(ref_conf), "--host", "127.0.0.1"),
                *("--port", str(ref_port), "--num-speculative-tokens", "0"),
            ],
            "ref",
            tmp_path / "ref.log",
            f"http://127.0.0.1:{ref_port}",
            {},
        )
        everything.append(ref)
        prefill, decode = pods["prefill"][0], pods["decode"][0]
        gateway = _gateway(objs, spec, prefill.url, decode.url, tmp_path)
        everything.append(gateway)
        for s in everything:
            s.wait_ready(240)
        pid = prefill.services[1].pid
        assert pid is not None and len(_rank_processes(pid)) == 2
        deadline = time.monotonic() + 60
        while httpx.get(gateway.url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, gateway.tail()
            time.sleep(0.2)
        with ThreadPoolExecutor(5) as pool:
            want = list(pool.map(lambda it: greedy_tokens(ref.url, *it), ITEMS))
            got = list(pool.map(lambda it: greedy_tokens(gateway.url, *it), ITEMS))
        assert got == want
        engine = decode.services[1]
        pulls = engine.metric("dsv4_kv_engine_transfers_total", direction="pull", outcome="ok")
        assert pulls >= len(ITEMS)  # decode really pulled the CP prefill's KV
        assert engine.metric("dsv4_kv_recomputes_total") == 0
    except BaseException:
        for s in everything:
            print(f"--- {s.name} ---\n{s.tail(40)}")
        raise
    finally:
        for s in reversed(everything):
            s.stop()
