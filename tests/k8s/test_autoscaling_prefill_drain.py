"""Drain of a prefill instance while a decode engine is still pulling its KV, on the real control
plane with REAL dsv4-tiny engines and real KV sidecars as processes on 127.0.0.1
(``ProcessNodes``), through the autoscaler's own mechanism: ``kubectl scale dsv4rs`` (External
mode) makes the operator list the victim in ``<name>-routing`` (the gateway stops sending it
work) and step its drain on direct reads of the engine and the sidecar's held exports.

The victim's sidecar sends at ``SEND_RATE`` bytes/s, so one pull of a long prompt's KV lasts
seconds: the drain is started while a pull is provably in progress (the victim holds an export
and the decode engine waits for remote KV), not just after an export was registered. Without
the rate limit the pull is over before the operator's first read (seen in
``test_autoscaling_processes``' second run).

The engine's and the sidecar's SIGTERM drains would hide an early deletion (the sidecar keeps
serving held exports after SIGTERM; a failed pull is recomputed locally by the decode engine), so
the test reads what the victim held just before its SIGTERM (``Instance.at_stop``) and the decode
engine's pull failures and local recomputes.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsv4_common.ports import KV_PORT, sidecar_metrics_port
from dsv4_common.process import metric_value
from dsv4_devcluster.process_nodes import Instance, ProcessNodes
from dsv4_kvtransfer.peer_server import RATE_PIECE
from tests.helpers import wait_for
from tests.k8s.operator_fixtures import apply_yaml
from tests.k8s.test_autoscaling_processes import (
    _cr,
    _events,
    _finished_all,
    _instances,
    _members,
    _operator,
    _routed,
    _Stream,
)

PROMPT_TOKENS = 1900
"""Its KV in dsv4-tiny float32 is about 1.2 MB: more than one of the limited sidecar's pieces."""
STREAMS = 2
"""Sent at once, so the gateway's prefill policy (in-flight prompt tokens) gives each prefill
instance one."""
SEND_RATE = 150_000
"""Bytes/s the victim's sidecar sends (the other sidecars are not limited). The limiter lets a
send go at once and makes the next wait for it, and a limited sidecar sends 1 MiB pieces: the
victim's pull sends its first MiB, then waits about 7 s before the last 136 KB. One pull only:
the decode engine's call to its sidecar gives up after 10 s, and a pull of at most 64 MiB
answers that call only when it is done (the sidecar's inline pull), so a second pull queued
behind the first would be taken for an unreachable sidecar (a bug this test found:
docs/autoscaling.md)."""


@pytest.fixture
def slow_nodes(
    k8s_cluster: Any, namespace: str, tmp_path: Path
) -> Iterator[tuple[Any, ProcessNodes]]:
    token = tmp_path / "kv-token"
    token.write_text("p" * 32)
    name = "pdrain"
    autoscaling = {
        "enabled": True,
        "mode": "External",
        "intervalSeconds": 1,
        "drainTimeoutSeconds": 240,
        "prefill": {"min": 1, "max": 2},
        "decode": {"min": 1, "max": 1},
    }
    cr = _cr(name, autoscaling)
    cr["metadata"]["namespace"] = namespace
    # _cpu_cr shares one dict between the roles: give each its own before they differ
    cr["spec"]["prefill"] = {**cr["spec"]["prefill"], "instances": 2}
    cr["spec"]["decode"] = {**cr["spec"]["decode"], "instances": 1}
    nodes = ProcessNodes(
        cluster=k8s_cluster,
        namespace=namespace,
        deployment=name,
        token_file=token,
        log_dir=tmp_path,
        engine_args=["--num-kv-blocks", "400", "--max-model-len", "2048"],
        sidecar_metrics_port=sidecar_metrics_port(cr["spec"]["kvTransfer"].get("port", KV_PORT)),
        # the victim's pulls outlive the operator's first reads
        instance_sidecar_settings={f"{name}-prefill-1": {"send_rate": SEND_RATE}},
    )
    try:
        yield cr, nodes
    finally:
        nodes.stop()


def _sidecar(inst: Instance, name: str, **labels: str) -> float:
    url = f"http://127.0.0.1:{inst.sidecar.metrics_port}/metrics"
    return metric_value(httpx.get(url, timeout=5).text, name, **labels)


def test_prefill_drain_waits_for_a_pull_in_progress(
    k8s_cluster: Any, operator_kubeconfig: Path, namespace: str, slow_nodes: Any
) -> None:
    cluster, ns = k8s_cluster, namespace
    cr, nodes = slow_nodes
    name = cr["metadata"]["name"]
    op = _operator(cluster, operator_kubeconfig, nodes)
    try:
        apply_yaml(cluster, json.dumps(cr), ns)
        nodes.start()
        gw = nodes.start_gateway()
        wait_for(
            "two prefill engines and one decode engine behind the gateway",
            lambda: len(_members(gw.url, "prefill")) == 2 and len(_members(gw.url, "decode")) == 1,
            timeout_s=240,
        )
        victim = next(i for i in nodes.by_role("prefill") if i.name == f"{name}-prefill-1")
        decode = nodes.by_role("decode")[0]
        for inst in nodes.instances.values():  # nothing held before the load
            ready = inst.at_ready
            free, size = ready["dsv4_kv_staging_free_bytes"], ready["dsv4_kv_staging_bytes"]
            assert free == size, (inst.name, ready)
        decode_free = decode.at_ready["dsv4_kv_staging_free_bytes"]

        # distinct long prompts (no prefix hits), spread over both prefill instances
        prompts = [[(i * 7 + j) % 200 + 5 for j in range(PROMPT_TOKENS)] for i in range(STREAMS)]
        streams = [_Stream(gw.url, p, 24) for p in prompts]
        for s in streams:
            s.start()

        def pulling() -> bool:
            """The decode engine waits for remote KV while the victim holds its export and has
            not sent all of it: the pull is under way, with most of its 7 s left (more than the
            scale, the operator's tick and the gateway's watch take)."""
            waiting = decode.engine.metric("dsv4_kv_requests_waiting_for_remote_kv")
            held = _sidecar(victim, "dsv4_kv_active_exports")
            sent = _sidecar(victim, "dsv4_kv_transfer_bytes_total", direction="sent")
            most["waiting"], most["held"] = max(most["waiting"], waiting), max(most["held"], held)
            most["sent"] = sent
            return waiting >= 1 and held >= 1 and sent <= RATE_PIECE  # the last piece waits

        most = {"waiting": 0.0, "held": 0.0, "sent": 0.0}
        try:
            wait_for("a pull of the victim's KV in progress", pulling, timeout_s=180, every_s=0.05)
        except AssertionError as e:
            routed = _routed(gw.url)
            raise AssertionError(f"{e}; most seen {most}; routed {routed}") from None
        t_drain = time.time()
        cluster.kubectl("scale", "dsv4rs", f"{name}-prefill", "-n", ns, "--replicas=1")
        wait_for(
            f"the gateway to drop {victim.name}",
            lambda: victim.engine.url not in _members(gw.url, "prefill"),
            timeout_s=30,
            every_s=0.1,
        )
        # the mark is in place and the victim still serves a pull: a drain with a pull in flight
        held_after_mark = _sidecar(victim, "dsv4_kv_active_exports")
        assert held_after_mark >= 1, "the pull ended before the drain started; raise the rate limit"
        assert victim.name in _instances(cluster, ns, name, "prefill")

        # new requests while it drains: all served, none routed to the victim
        routed = _routed(gw.url).get(victim.engine.url, 0.0)
        assert routed > 0  # it had work before the drain
        extra = [_Stream(gw.url, f"a new request {i}", 4) for i in range(4)]
        for s in extra:
            s.start()
        _finished_all(extra, 4)
        assert _routed(gw.url).get(victim.engine.url, 0.0) == routed

        wait_for(
            f"{victim.name} removed",
            lambda: victim.name not in _instances(cluster, ns, name, "prefill"),
            timeout_s=240,
        )
        stopped = wait_for(
            f"{victim.name}'s processes stopped",
            lambda: next(
                (t for t, i, w in list(nodes.history) if i == victim.name and w == "stopped"), None
            ),
            timeout_s=60,
        )
        _finished_all(streams, 24)
        # the decode sidecar gives back every import once its engine took the KV
        wait_for(
            "decode staging back to its initial free bytes",
            lambda: _sidecar(decode, "dsv4_kv_staging_free_bytes") == decode_free,
            timeout_s=60,
        )
        pulls_ok = _sidecar(decode, "dsv4_kv_pulls_total", outcome="done")
        pull_s = _sidecar(decode, "dsv4_kv_transfer_latency_seconds_sum")
        recomputes = decode.engine.metric("dsv4_kv_recomputes_total")
        failures = decode.engine.metric("dsv4_kv_pull_failures_total")
        failures += decode.engine.metric("dsv4_kv_request_errors_total")
    finally:
        op.stop()

    stop = victim.at_stop
    # it sent the one export it held, whole, once: more than a piece, less than two exports
    assert RATE_PIECE < stop["dsv4_kv_transfer_bytes_total"] < 2 * RATE_PIECE, stop
    # deleted only once idle: nothing running or queued, every export pulled and released
    assert stop["vllm:num_requests_running"] == 0 and stop["vllm:num_requests_waiting"] == 0, stop
    assert stop["dsv4_kv_active_exports"] == 0, stop
    assert stop["dsv4_kv_staging_free_bytes"] == stop["dsv4_kv_staging_bytes"], stop
    # every KV arrived by pull: none failed and was recomputed locally (which would hide a
    # victim deleted mid-pull)
    assert recomputes == 0 and failures == 0, (recomputes, failures)
    assert pulls_ok >= len(streams) + len(extra), pulls_ok

    events = _events(cluster, ns, name)
    reasons = [(e["reason"], e["message"]) for e in events]
    started = next(m for r, m in reasons if r == "DrainStarted" and victim.name in m)
    m = re.search(r"\((\d+) in flight\)", started)
    assert m and int(m.group(1)) >= 1, started  # the operator's first read saw the pull
    done = [i for i, (r, m_) in enumerate(reasons) if r == "DrainCompleted" and victim.name in m_]
    down = [i for i, (r, m_) in enumerate(reasons) if r == "ScaledDown" and victim.name in m_]
    assert done and down and done[0] < down[0], reasons
    assert not any(r == "DrainTimedOut" for r, _ in reasons), reasons
    print(
        f"\nprefill drain with a pull in flight: {started!r} -> {reasons[done[0]][1]!r}; "
        f"held after the mark {held_after_mark:.0f}, deleted {stopped - t_drain:.1f}s after "
        f"the scale; decode pulls {pulls_ok:.0f} in {pull_s:.1f}s total (rate {SEND_RATE} B/s)",
        file=sys.stderr,
    )
