"""A rolling update of the tiny example on real pods under a steady load of streaming requests:
an engine flag change rolls both roles (surge instances first, old ones drained by SIGTERM and
replaced), every request succeeds, and the gateway pairs no prefill with a decode of another
revision."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.node.conftest import RealClusterHandle, deployment
from tests.node.test_operator_e2e import gateway_url, tiny_on_real_node

NS = "dsv4-rollout"
USERS = 2


def _status(cluster: Any) -> dict[str, Any]:
    """The CR's status; {} when the API server does not answer in time (a loaded 2-core host:
    the verdict is the requests', the poll just tries again)."""
    try:
        cr = json.loads(cluster.kubectl("get", "dsv4", "tiny", "-n", NS, "-o", "json"))
    except subprocess.TimeoutExpired:
        return {}
    status: dict[str, Any] = cr.get("status") or {}
    return status


def _pairs(url: str) -> dict[tuple[str, str], float]:
    """dsv4_gateway_pd_pairs_total by (prefill revision, decode revision)."""
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.labels["prefill_revision"], s.labels["decode_revision"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "dsv4_gateway_pd_pairs_total"
    }


class Load:
    """``USERS`` clients streaming 24-token completions back to back."""

    def __init__(self, url: str) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=url, api_key="unused", timeout=60, max_retries=0)
        self.results: list[tuple[float, float, str]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._user, daemon=True) for _ in range(USERS)]

    def _user(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                stream = self.client.completions.create(
                    model="dsv4-tiny",
                    prompt="a user streaming through a rollout",
                    max_tokens=24,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                tokens = sum(1 for c in stream if c.choices and c.choices[0].text)
                self.results.append((t0, time.monotonic(), "ok" if tokens else "empty"))
            except Exception as e:  # an HTTP error or a cut stream: what a user sees
                self.results.append((t0, time.monotonic(), f"{type(e).__name__}: {e}"[:200]))
                time.sleep(0.2)

    def ok_after(self, t: float) -> int:
        return sum(1 for r in self.results if r[0] > t and r[2] == "ok")


@pytest.mark.timeout(1200)  # two pod starts per role after the deployment's own
def test_a_rolling_update_under_streaming_load_fails_no_request(
    real_cluster: Any,
    real_handle: RealClusterHandle,
    app_images: dict[str, str],
    chart_operator: None,
) -> None:
    with deployment(real_cluster, tiny_on_real_node(app_images, NS)):
        url = gateway_url(real_cluster, NS, "tiny")
        before = _status(real_cluster).get("revision")
        assert before, "the deployment reports no revision"
        load = Load(url)
        for t in load.threads:
            t.start()
        try:
            deadline = time.monotonic() + 120
            while load.ok_after(0) < 2:
                assert time.monotonic() < deadline, load.results[-5:]
                time.sleep(0.2)
            t_patch = time.monotonic()
            real_cluster.kubectl(
                "patch",
                "dsv4",
                "tiny",
                "-n",
                NS,
                "--type=merge",
                "-p",
                json.dumps({"spec": {"decode": {"engineArgs": ["--max-num-seqs", "32"]}}}),
            )
            deadline = t_patch + 600
            while True:
                st = _status(real_cluster)
                if st.get("revision") != before and st.get("phase") == "Ready":
                    break
                assert time.monotonic() < deadline, f"not rolled out: {st}"
                time.sleep(1)
            t_done = time.monotonic()
            while load.ok_after(t_done) < 2:  # the new revision serves
                assert time.monotonic() < t_done + 120, load.results[-5:]
                time.sleep(0.2)
        finally:
            load.stop.set()
            for t in load.threads:
                t.join(timeout=90)
            outcomes: dict[str, int] = {}
            for r in load.results:
                outcomes[r[2]] = outcomes.get(r[2], 0) + 1
            real_handle.notes["rollout: request outcomes"] = [
                f"{n} x {k}" for k, n in outcomes.items()
            ]
        after = st["revision"]
        pairs = _pairs(url)
    assert not any(t.is_alive() for t in load.threads), "a request hung"
    during = [r for r in load.results if r[1] >= t_patch]
    failures = [r[2] for r in load.results if r[2] != "ok"]
    real_handle.timings["rollout: patch to RolledOut (s)"] = t_done - t_patch
    real_handle.timings["rollout: requests ended during it"] = float(len(during))
    real_handle.notes["rollout: failures"] = failures
    assert not failures, failures
    assert len(during) >= 4, "too little load to prove anything"
    # every pair within one revision, and both revisions served
    assert pairs and all(p == d for p, d in pairs), pairs
    assert pairs.get((before, before), 0) > 0 and pairs.get((after, after), 0) > 0, pairs
