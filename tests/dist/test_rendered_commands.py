"""The operator's rendered pods, run as processes on 127.0.0.1, serve the single-process tokens.

One CPU deployment holds both shapes: prefill ``parallelism: {tp: 2}`` in one pod (two rank
processes), decode ``nodesPerInstance: 2`` with ``tp: 2`` (a leader pod and a headless follower
pod, one rank each, TP across the "nodes"). The operator's real renderer (``desired_children``)
gives the StatefulSets, the gateway Deployment, engine.json and the KV Secret; every container
of every pod runs its rendered command with its rendered environment (the downward API resolved
as the kubelet would). What a pod has and one host does not is substituted, and only that:

- the pod's network namespace: each pod's ports (engine 8000, KV 14579-14581, KV events
  5557-5558, gateway 8000) become free ports of 127.0.0.1, in flags and URLs alike; ``--host 0.0.0.0`` becomes
  127.0.0.1; the leader's DNS name (``DSV4_MASTER_ADDR``) and ``status.podIP`` become
  127.0.0.1; the rendezvous port (29550 in every pod) is set to a free port
  (``DSV4_MASTER_PORT``, the engine's own env name);
- the pod's volumes: engine.json and the token are written to files (engine.json's sidecar URL
  with that pod's control port);
- the gateway's Kubernetes discovery (no API server here; the k8s tier tests it): static
  ``--prefill``/``--decode`` URLs of the same engines.

The reference is one ``dsv4 engine`` process (role both) with the same engine.json.
"""

from __future__ import annotations

import base64
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsv4_common.ports import ENGINE_PORT
from dsv4_common.process import Service, dsv4_argv, free_port, free_ports
from dsv4_operator.api.spec import DeploymentSpec, parse
from dsv4_operator.reconcile import Facts, desired_children, names
from dsv4_operator.reconcile.identity import STS_POD_INDEX
from tests.engine.common import workload

from .processes import greedy_tokens, group_members

pytestmark = pytest.mark.dist

TOKEN = "a-shared-secret-for-the-rendered-pods-0123456789"
CR: dict[str, Any] = {
    "apiVersion": "serving.dsv4.io/v1alpha1",
    "kind": "DeepSeekV4Deployment",
    "metadata": {"name": "tiny", "namespace": "ml", "uid": "u-1"},
    "spec": {
        "model": {
            "preset": "dsv4-tiny",
            "servedName": "dsv4-tiny",
            "dtype": "float32",
            "maxModelLen": 384,
        },
        "prefill": {
            "npusPerNode": 0,
            "parallelism": {"tp": 2},
            "mtpTokens": 1,
            "resources": {"limits": {"cpu": "2"}},  # 2 ranks: 1 thread each
            "shmSize": "320Mi",
        },
        "decode": {
            "npusPerNode": 0,
            "nodesPerInstance": 2,
            "parallelism": {"tp": 2},
            "mtpTokens": 1,
            "resources": {"requests": {"cpu": "1"}},  # 1 rank per pod: 1 thread
            "shmSize": "320Mi",
        },
        "kvTransfer": {"transport": "tcp"},
    },
}
ITEMS = workload(5, 9, shared_prefix=16)


@dataclass
class Pod:
    """One engine pod as processes: its containers' argv and env, with the ports it got."""

    name: str
    node_rank: int
    engine_port: int
    kv_base: int
    services: list[Service] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"


def _env(
    container: dict[str, Any], pod: str, node_rank: int, spec: DeploymentSpec
) -> dict[str, str]:
    """The container's env as the kubelet resolves it (downward API, $(VAR) references)."""
    fields = {
        "metadata.name": pod,
        "metadata.namespace": spec.namespace,
        "status.podIP": "127.0.0.1",
        "spec.nodeName": f"node-{node_rank}",
        f"metadata.labels['{STS_POD_INDEX}']": str(node_rank),
    }
    out: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            out[var["name"]] = _expand(var["value"], out)
        else:
            out[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


def _expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


PORT_FLAGS = ("--port", "--control-port", "--metrics-port")


def _ports(argv: list[str], mapping: dict[int, int]) -> list[str]:
    """Every rendered port, as a port flag's value or in a URL, replaced by this pod's."""
    out: list[str] = []
    for a in argv:
        if out and out[-1] in PORT_FLAGS:
            a = str(mapping[int(a)])  # a port the test does not know fails here
        a = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{mapping.get(int(m[1]), m[1])}", a)
        out.append("127.0.0.1" if a == "0.0.0.0" else a)
    return out


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _without(argv: list[str], *flags: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


def _run(
    argv: list[str], name: str, log: Path, url: str, env: dict[str, str], path: str = "/health"
) -> Service:
    assert argv[0] == "dsv4"
    s = Service(name, dsv4_argv(*argv[1:]), log, url, path)
    s.start(env={**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    return s


def _objects(spec: DeploymentSpec) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in desired_children(spec, Facts(TOKEN))}


def _start_pods(
    spec: DeploymentSpec, objs: dict[tuple[str, str], dict[str, Any]], tmp: Path, taken: set[int]
) -> dict[str, list[Pod]]:
    config = json.loads(objs[("ConfigMap", "tiny-engine")]["data"]["engine.json"])
    token = tmp / "token"
    token.write_bytes(
        base64.b64decode(objs[("Secret", names.kv_secret_name(spec))]["data"]["token"])
    )
    kv = spec.kv
    pods: dict[str, list[Pod]] = {}
    for role in ("prefill", "decode"):
        sts = objs[("StatefulSet", names.instance_name(spec, role, 0))]
        template = sts["spec"]["template"]["spec"]
        master_port = free_port()
        # the instance's KV-events ports (2 per DP rank): each instance's own on this host
        events = free_ports(2 * spec.role(role).parallelism.dp, taken)
        pods[role] = []
        for i in range(sts["spec"]["replicas"]):
            name = f"{sts['metadata']['name']}-{i}"
            pod = Pod(name, i, free_port(), free_ports(3, taken))
            mapping = {
                ENGINE_PORT: pod.engine_port,
                kv.port: pod.kv_base,
                kv.control_port: pod.kv_base + 1,
                kv.metrics_port: pod.kv_base + 2,
            }
            conf = tmp / f"{name}.engine.json"
            own = {"kv_sidecar": _ports([config["kv_sidecar"]], mapping)[0]}
            if "kv_events_endpoint" in config:  # node-local, but every node must agree
                own["kv_events_endpoint"] = f"tcp://127.0.0.1:{events}"
            conf.write_text(json.dumps({**config, **own}))
            by_name = {c["name"]: c for c in template["containers"]}
            side = by_name["kv-sidecar"]
            argv = _ports([_expand(a, _env(side, name, i, spec)) for a in side["command"]], mapping)
            argv[argv.index("--auth-token-file") + 1] = str(token)
            pod.services.append(
                _run(
                    argv,
                    f"{name}/kv-sidecar",
                    tmp / f"{name}.sidecar.log",
                    f"http://127.0.0.1:{pod.kv_base + 2}",
                    _env(side, name, i, spec),
                    "/ready",
                )
            )
            eng = by_name["engine"]
            env = _env(eng, name, i, spec)
            assert env["DSV4_MASTER_ADDR"] == names.leader_address(spec, role, 0)
            env.update(DSV4_MASTER_ADDR="127.0.0.1", DSV4_MASTER_PORT=str(master_port))
            argv = _ports([_expand(a, env) for a in eng["command"]], mapping)
            argv[argv.index("--config") + 1] = str(conf)
            pod.services.append(
                _run(argv, f"{name}/engine", tmp / f"{name}.engine.log", pod.url, env)
            )
            pods[role].append(pod)
    return pods


def _rank_processes(pgid: int) -> list[str]:
    return sorted(n for n in group_members(pgid).values() if n.startswith("dsv4-rank"))


def test_rendered_tp2_and_two_node_pods_serve_the_single_process_tokens(
    tmp_path: Path,
) -> None:
    spec = parse(json.loads(json.dumps(CR)))
    objs = _objects(spec)
    taken: set[int] = set()
    everything: list[Service] = []
    try:
        pods = _start_pods(spec, objs, tmp_path, taken)
        everything += [s for ps in pods.values() for p in ps for s in p.services]
        # the reference: one process, the same engine.json, no sidecar
        config = json.loads(objs[("ConfigMap", "tiny-engine")]["data"]["engine.json"])
        ref_conf = tmp_path / "ref.engine.json"
        ref_conf.write_text(
            json.dumps({k: v for k, v in config.items() if not k.startswith("kv_")})
        )
        ref_port = free_port()
        ref = _run(
            [
                "dsv4",
                "engine",
                "--config",
                str(ref_conf),
                "--host",
                "127.0.0.1",
                "--port",
                str(ref_port),
                "--num-speculative-tokens",
                "1",
                "--threads-per-rank",
                "1",
            ],
            "ref",
            tmp_path / "ref.log",
            f"http://127.0.0.1:{ref_port}",
            {},
        )
        everything.append(ref)
        gw = objs[("Deployment", names.gateway_name(spec))]["spec"]["template"]["spec"][
            "containers"
        ][0]
        gw_port = free_port()
        argv = _without(
            gw["command"], "--discovery", "--namespace", "--selector", "--routing-configmap"
        )
        argv = _ports(argv, {names.GATEWAY_PORT: gw_port})
        argv += [
            "--discovery",
            "static",
            "--prefill",
            pods["prefill"][0].url,
            "--decode",
            pods["decode"][0].url,
        ]
        gateway = _run(
            argv, "gateway", tmp_path / "gateway.log", f"http://127.0.0.1:{gw_port}", {}, "/ready"
        )
        everything.append(gateway)

        # what the renderer said about the ranks: threads from the pods' CPUs, node ranks
        prefill_cmd = objs[("StatefulSet", "tiny-prefill-0")]["spec"]["template"]["spec"][
            "containers"
        ][0]["command"]
        decode_cmd = objs[("StatefulSet", "tiny-decode-0")]["spec"]["template"]["spec"][
            "containers"
        ][0]["command"]
        assert _flag(prefill_cmd, "--tensor-parallel-size") == "2"
        assert _flag(prefill_cmd, "--threads-per-rank") == "1"
        assert _flag(decode_cmd, "--threads-per-rank") == "1"
        assert objs[("StatefulSet", "tiny-decode-0")]["spec"]["replicas"] == 2

        for s in everything:
            s.wait_ready(240)
        leader, follower = pods["decode"]
        engine_of = {p.name: p.services[1] for ps in pods.values() for p in ps}
        # the prefill pod runs both of its ranks; each decode pod one, the follower headless
        for name, want in (("tiny-prefill-0-0", 2), ("tiny-decode-0-0", 1), ("tiny-decode-0-1", 1)):
            pid = engine_of[name].pid
            assert pid is not None
            assert len(_rank_processes(pid)) == want, (name, _rank_processes(pid))
        assert engine_of[follower.name].metric("dsv4_headless_ranks_alive", node_rank="1") == 1
        assert httpx.get(follower.url + "/v1/models").status_code == 404

        deadline = time.monotonic() + 60
        while httpx.get(gateway.url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, gateway.tail()
            time.sleep(0.2)
        with ThreadPoolExecutor(5) as pool:
            want = list(pool.map(lambda it: greedy_tokens(ref.url, *it), ITEMS))
            got = list(pool.map(lambda it: greedy_tokens(gateway.url, *it), ITEMS))
        assert got == want
        pulls = engine_of[leader.name].metric(
            "dsv4_kv_engine_transfers_total", direction="pull", outcome="ok"
        )
        assert pulls >= len(ITEMS)  # decode really pulled the prefill pod's KV
        assert engine_of[leader.name].metric("dsv4_kv_recomputes_total") == 0
    except BaseException:
        for s in everything:
            print(f"--- {s.name} ---\n{s.tail(40)}")
        raise
    finally:
        for s in reversed(everything):
            s.stop()
