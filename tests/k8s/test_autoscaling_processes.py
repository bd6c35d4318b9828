"""The autoscaler closed-loop on the real control plane, with engines running as processes behind
the kwok pods (``dsv4_devcluster.process_nodes.ProcessNodes``): the real operator reads the real
gateway's metrics, scales the StatefulSets, drains through the routing ConfigMap the real
gateway watches, and the load is ``dsv4 bench --schedule`` against that gateway.

- ``test_low_high_low_scales_both_roles_and_back_without_an_error``: EMULATED engines
  (``--emulate-step-time``; capacity is the point, and two cores cannot add real capacity): a
  low -> high -> low schedule takes prefill and decode 1 -> 2 -> 1 within min/max, every
  ``ScaledDown`` follows the ``DrainCompleted`` of its instance, the operator is killed
  (SIGKILL) in the middle of the first drain and its successor finishes it, and the bench sees
  0 errors.
- ``test_drain_with_real_engines_loses_no_stream``: REAL engines (dsv4-tiny): with 16 long
  streams in flight, ``kubectl scale dsv4rs`` (External mode) drains one of two decode
  instances (the operator's ``POST /drain`` moves its streams with their KV to the other, which
  recomputes none of them), then one of two prefill instances while decode engines pull its KV:
  no new request reaches the victim, all 16 streams end with their full token count, 0 fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsv4_common.ports import KV_PORT, sidecar_metrics_port
from dsv4_common.process import dsv4_argv, metric_value
from dsv4_devcluster.process_nodes import ProcessNodes
from tests.helpers import wait_for
from tests.k8s.operator_fixtures import OperatorService, apply_yaml, kubectl_json
from tests.k8s.test_operator import _status
from tests.k8s.test_operator_reliability import _cpu_cr

EMULATED = "20,3,0.2"
"""base 20 ms + 3 ms per sequence + 0.2 ms per token: a 256-word prompt (about 1000 tokens of the
byte-level tiny tokenizer) is a 223 ms step; at 6 requests/s one decode instance runs about 40
sequences at about 140 ms a step (TPOT breached), two run about 5 each at 35 ms."""


def _cr(name: str, autoscaling: dict[str, Any]) -> dict[str, Any]:
    cr = _cpu_cr(name, autoscaling=autoscaling)
    cr["spec"]["gateway"] = {"replicas": 1}
    return cr


def _operator(cluster: Any, kubeconfig: Path, nodes: ProcessNodes) -> OperatorService:
    extra = ("--autoscaler-address-map", str(nodes.address_map))
    return OperatorService(kubeconfig, cluster.log_dir, extra).launch()


def _forget_dead_peers(cluster: Any, peering: str = "dsv4-operator") -> None:
    """Drop every entry of kopf's peering object (no replica runs: the one killed is the last).
    A SIGKILLed replica's entry stays live for kopf's 60 s lifetime, and the successor (or the
    next test's operator) of the same priority pauses until it expires: a wait of kopf's that
    these tests are not about (test_operator.py elects replicas)."""
    peers = kubectl_json(cluster, "get", "clusterkopfpeering", peering).get("status") or {}
    if peers:
        patch = json.dumps({"status": dict.fromkeys(peers)})
        cluster.kubectl("patch", "clusterkopfpeering", peering, "--type=merge", "-p", patch)


def _events(cluster: Any, ns: str, name: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = kubectl_json(
        cluster, "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name}"
    )["items"]
    return sorted(items, key=lambda e: int(e["metadata"]["resourceVersion"]))


def _instances(cluster: Any, ns: str, name: str, role: str) -> list[str]:
    items = kubectl_json(
        cluster,
        "get",
        "statefulsets",
        "-n",
        ns,
        "-l",
        f"app.kubernetes.io/instance={name},serving.dsv4.io/role={role}",
    )["items"]
    return sorted(o["metadata"]["name"] for o in items)


class _Sampler(threading.Thread):
    """Instance StatefulSets per role every half second: the most seen at once is the max."""

    def __init__(self, cluster: Any, ns: str, name: str) -> None:
        super().__init__(daemon=True)
        self.args = (cluster, ns, name)
        self.seen: list[tuple[float, int, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            try:
                p = len(_instances(*self.args, "prefill"))
                d = len(_instances(*self.args, "decode"))
            except Exception:
                continue
            self.seen.append((time.time(), p, d))


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "kv-token"
    path.write_text("t" * 32)
    return path


@pytest.fixture
def nodes_for(k8s_cluster: Any, namespace: str, token_file: Path, tmp_path: Path) -> Iterator[Any]:
    made: list[ProcessNodes] = []

    def make(name: str, cr: dict[str, Any], engine_args: list[str]) -> ProcessNodes:
        cr["metadata"]["namespace"] = namespace
        nodes = ProcessNodes(
            cluster=k8s_cluster,
            namespace=namespace,
            deployment=name,
            token_file=token_file,
            log_dir=tmp_path,
            engine_args=engine_args,
            sidecar_metrics_port=sidecar_metrics_port(
                cr["spec"]["kvTransfer"].get("port", KV_PORT)
            ),
        )
        made.append(nodes)
        return nodes

    yield make
    for n in made:
        n.stop()


def _bench(url: str, tmp: Path, *args: str) -> subprocess.Popen[str]:
    argv = dsv4_argv(
        "bench",
        *("--url", url, "--model", "tiny", "--json", "--no-progress"),
        *("--records", str(tmp / "records.jsonl"), "--timeout", "120"),
        *args,
    )
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_low_high_low_scales_both_roles_and_back_without_an_error(
    k8s_cluster: Any, operator_kubeconfig: Path, namespace: str, nodes_for: Any, tmp_path: Path
) -> None:
    cluster, ns, name = k8s_cluster, namespace, "loop"
    autoscaling = {
        "enabled": True,
        "ttftSeconds": 1.0,
        "tpotSeconds": 0.05,
        "intervalSeconds": 1,
        "windowSeconds": 5,
        "scaleDownStabilizationSeconds": 10,
        "drainTimeoutSeconds": 120,
        "prefill": {"min": 1, "max": 2, "tokensPerSecond": 6000},
        "decode": {"min": 1, "max": 2, "runningPerInstance": 8},
    }
    cr = _cr(name, autoscaling)
    engine_args = ["--emulate-step-time", EMULATED, "--num-speculative-tokens", "0"]
    engine_args += ["--num-kv-blocks", "800", "--max-model-len", "2048"]
    nodes = nodes_for(name, cr, engine_args)
    ops = [_operator(cluster, operator_kubeconfig, nodes)]
    sampler = _Sampler(cluster, ns, name)
    try:
        apply_yaml(cluster, json.dumps(cr), ns)
        nodes.start()
        gw = nodes.start_gateway()
        wait_for(
            "one prefill and one decode engine behind the gateway",
            lambda: (
                {i["role"] for i in httpx.get(f"{gw.url}/instances").json()}
                >= {"prefill", "decode"}
            ),
            timeout_s=180,
        )
        sampler.start()
        bench = _bench(
            gw.url,
            tmp_path,
            *("--schedule", "8s@0.5,30s@6,45s@0.5", "--input-len", "256", "--output-len", "48"),
        )

        # the first drain: kill the operator in the middle of it, a successor takes it up
        wait_for(
            "a scale-up of both roles",
            lambda: (
                len(_instances(cluster, ns, name, "prefill")) == 2
                and len(_instances(cluster, ns, name, "decode")) == 2
            ),
            timeout_s=90,
        )
        wait_for(
            "the first drain in the status",
            lambda: any(
                _status(cluster, ns, name)[r].get("draining") for r in ("prefill", "decode")
            ),
            timeout_s=120,
            every_s=0.2,
        )
        os.killpg(ops[-1].pid, signal.SIGKILL)
        _forget_dead_peers(cluster)
        ops.append(_operator(cluster, operator_kubeconfig, nodes))

        out, err = bench.communicate(timeout=300)
        assert bench.returncode == 0, err[-2000:]
        summary = json.loads(out)
        wait_for(
            "back to one prefill and one decode instance",
            lambda: (
                len(_instances(cluster, ns, name, "prefill")) == 1
                and len(_instances(cluster, ns, name, "decode")) == 1
            ),
            timeout_s=90,
        )
    finally:
        sampler.done.set()
        for op in ops:
            op.stop()

    assert summary["failed"] == 0, summary["errors"]
    phases = summary["phases"]
    assert [p["failed"] for p in phases] == [0, 0, 0]
    # within min/max all along, and both roles went to 2
    assert max(p for _, p, _ in sampler.seen) == 2 and max(d for _, _, d in sampler.seen) == 2
    assert min(p for _, p, _ in sampler.seen) == 1 and min(d for _, _, d in sampler.seen) == 1
    events = _events(cluster, ns, name)
    reasons = [e["reason"] for e in events]
    assert reasons.count("ScaledUp") >= 2, reasons
    downs = [e for e in events if e["reason"] == "ScaledDown"]
    assert len(downs) == 2, reasons
    for e in downs:
        victim = e["message"].split(": ", 1)[1].split(" removed", 1)[0]
        completed = [
            i
            for i, x in enumerate(events)
            if x["reason"] == "DrainCompleted" and f" {victim} " in x["message"]
        ]
        assert completed and completed[0] < events.index(e), (victim, reasons)
    st = _status(cluster, ns, name)
    assert st["prefill"]["desired"] == 1 and st["decode"]["desired"] == 1
    print(
        "\nlow-high-low (emulated",
        EMULATED,
        "):",
        [
            (p["requests"], round(p["ttft_s"]["p90"], 3), round(p["tpot_s"]["p90"], 3))
            for p in phases
        ],
        "history",
        [(round(t - nodes.history[0][0], 1), i, what) for t, i, what in nodes.history],
        file=sys.stderr,
    )


class _Stream(threading.Thread):
    """One streamed completion through the gateway: token count, finish reason or the error."""

    def __init__(self, url: str, prompt: str | list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.tokens = 0
        self.finish: str | None = None
        self.error: str | None = None
        self.started = threading.Event()

    def run(self) -> None:
        import openai

        client = openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=180)
        try:
            for chunk in client.completions.create(
                model="tiny",
                prompt=self.prompt,  # type: ignore[arg-type]
                max_tokens=self.max_tokens,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            ):
                choice = chunk.choices[0]
                self.tokens += len(getattr(choice, "token_ids", None) or [])
                self.finish = choice.finish_reason or self.finish
                self.started.set()
        except Exception as e:  # the test reports every failure, of any kind
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.started.set()


def _routed(gateway_url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    text = httpx.get(f"{gateway_url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "dsv4_gateway_routed_total":
                out[s.labels["instance"]] = out.get(s.labels["instance"], 0.0) + s.value
    return out


def _members(gateway_url: str, role: str) -> set[str]:
    return {
        i["url"]
        for i in httpx.get(f"{gateway_url}/instances", timeout=5).json()
        if i["role"] == role
    }


def _finished_all(streams: list[_Stream], max_tokens: int) -> None:
    for s in streams:
        s.join(timeout=180)
    bad = [(s.tokens, s.finish, s.error) for s in streams if s.error or s.tokens != max_tokens]
    assert not bad, bad
    assert {s.finish for s in streams} == {"length"}


def _drain_one(
    cluster: Any, ns: str, name: str, nodes: ProcessNodes, role: str, streams: list[_Stream]
) -> dict[str, Any]:
    """Scale ``role`` 2 -> 1 through its scale subresource; no new request reaches the victim
    once the gateway has dropped it; its StatefulSet goes after DrainCompleted."""
    gw = nodes.gateway
    assert gw is not None
    victim = next(i for i in nodes.by_role(role) if i.name == f"{name}-{role}-1")
    cluster.kubectl("scale", "dsv4rs", f"{name}-{role}", "-n", ns, "--replicas=1")
    wait_for(
        f"the gateway to drop {victim.name}",
        lambda: victim.engine.url not in _members(gw.url, role),
        timeout_s=30,
        every_s=0.1,
    )
    routed = _routed(gw.url).get(victim.engine.url, 0.0)
    # new requests meanwhile: all served, none by the victim
    extra = [_Stream(gw.url, "a new request", 4) for _ in range(4)]
    for s in extra:
        s.start()
    _finished_all(extra, 4)
    assert routed > 0  # it served before the drain
    assert _routed(gw.url).get(victim.engine.url, 0.0) == routed
    wait_for(
        f"{victim.name} removed",
        lambda: victim.name not in _instances(cluster, ns, name, role),
        timeout_s=120,
    )
    assert all(s.is_alive() or s.error is None for s in streams)
    events = _events(cluster, ns, name)
    reasons = [(e["reason"], e["message"]) for e in events]
    started = next(m for r, m in reasons if r == "DrainStarted" and victim.name in m)
    done = [i for i, (r, m) in enumerate(reasons) if r == "DrainCompleted" and victim.name in m]
    down = [i for i, (r, m) in enumerate(reasons) if r == "ScaledDown" and victim.name in m]
    assert done and down and done[0] < down[0], reasons
    return {"victim": victim.name, "started": started, "completed": reasons[done[0]][1]}


def _moved_with_their_kv(cluster: Any, ns: str, name: str, victim: Any, gateway: str) -> None:
    """The operator's ``POST /drain`` moved the victim's streams with their KV (DrainMigrating),
    the gateway continued them, and the victim was deleted with no export held (the drain
    waited for the peer's pulls)."""
    moving = [
        e["message"]
        for e in _events(cluster, ns, name)
        if e["reason"] == "DrainMigrating" and victim.name in e["message"]
    ]
    assert len(moving) == 1 and "moving with their KV" in moving[0], moving
    assert int(moving[0].split(": ")[1].split(" ")[0]) >= 1, moving
    continued = httpx.get(f"{gateway}/metrics", timeout=5).text
    assert metric_value(continued, "dsv4_gateway_stream_migrations_total", outcome="continued") >= 1
    # (its core's running gauge may still count the moved streams: the operator goes by the
    # engine's own in-flight count, drain.with_answer)
    at_stop = wait_for(f"{victim.name}'s last read", lambda: victim.at_stop, timeout_s=30)
    assert at_stop["dsv4_kv_active_exports"] == 0


def test_drain_with_real_engines_loses_no_stream(
    k8s_cluster: Any, operator_kubeconfig: Path, namespace: str, nodes_for: Any
) -> None:
    cluster, ns, name = k8s_cluster, namespace, "drain"
    autoscaling = {
        "enabled": True,
        "mode": "External",
        "intervalSeconds": 1,
        "drainTimeoutSeconds": 120,
        "prefill": {"min": 1, "max": 2},
        "decode": {"min": 1, "max": 2},
    }
    cr = _cr(name, autoscaling)
    cr["spec"]["prefill"]["instances"] = 2
    cr["spec"]["decode"]["instances"] = 2
    engine_args = ["--num-kv-blocks", "400", "--max-model-len", "2048"]
    nodes = nodes_for(name, cr, engine_args)
    op = _operator(cluster, operator_kubeconfig, nodes)
    try:
        apply_yaml(cluster, json.dumps(cr), ns)
        nodes.start()
        gw = nodes.start_gateway()
        wait_for(
            "two prefill and two decode engines behind the gateway",
            lambda: len(_members(gw.url, "prefill")) == 2 and len(_members(gw.url, "decode")) == 2,
            timeout_s=240,
        )

        # decode: 16 long streams, both decode instances busy, then decode-1 drains
        n = 160
        streams = [_Stream(gw.url, f"stream {i} once upon a time", n) for i in range(16)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.started.wait(120)
        victim = next(i for i in nodes.by_role("decode") if i.name.endswith("-1"))
        peer = next(i for i in nodes.by_role("decode") if i is not victim)
        assert victim.engine.metric("vllm:num_requests_running") >= 1  # it has streams to finish
        recomputes = peer.engine.metric("dsv4_kv_recomputes_total")
        decode = _drain_one(cluster, ns, name, nodes, "decode", streams)
        _finished_all(streams, n)
        _moved_with_their_kv(cluster, ns, name, victim, gw.url)
        # the peer pulled every moved stream's KV: it recomputed none
        assert peer.engine.metric("dsv4_kv_recomputes_total") == recomputes

        # prefill: long prompts, drained while a decode engine pulls the victim's KV
        victim = next(i for i in nodes.by_role("prefill") if i.name.endswith("-1"))
        prompts = [[(i * 7 + j) % 200 + 5 for j in range(700)] for i in range(16)]
        streams = [_Stream(gw.url, p, 48) for p in prompts]
        for s in streams:
            s.start()
        exports_url = f"http://127.0.0.1:{victim.sidecar.metrics_port}/metrics"

        def exports() -> float:
            return metric_value(httpx.get(exports_url, timeout=2).text, "dsv4_kv_active_exports")

        held = wait_for("an export held on the prefill victim", exports, timeout_s=60, every_s=0.02)
        prefill = _drain_one(cluster, ns, name, nodes, "prefill", streams)
        _finished_all(streams, 48)
    finally:
        op.stop()
    print(
        f"\nreal-engine drains: decode {decode}, prefill {prefill} (exports held {held})",
        file=sys.stderr,
    )
