"""`dsv4 bench` against a real engine behind the gateway."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from dsv4_common.process import dsv4_argv
from tests.gateway.conftest import gateway, running


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(dsv4_argv("bench", *args), capture_output=True, text=True, timeout=300)


def test_bench_reports_latency_and_throughput(two_engines, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a, b = two_engines
    with running(gateway("gateway-bench", "--engine", a.url, "--engine", b.url)) as (g,):
        res = _bench(
            "--url",
            g.url,
            "--num-requests",
            "12",
            "--concurrency",
            "4",
            "--input-len",
            "40",
            "--output-len",
            "8",
            "--ttft-slo",
            "30",
            "--tpot-slo",
            "5",
            "--json",
        )
        assert res.returncode == 0, res.stderr
        s = json.loads(res.stdout)
        assert s["completed"] == 12 and s["failed"] == 0
        assert s["output_tokens"] == 12 * 8  # ignore_eos: every answer is exactly max_tokens long
        for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            assert 0 < s[key]["p50"] <= s[key]["p99"]
        assert s["ttft_s"]["p50"] < s["e2e_s"]["p50"]
        assert s["goodput"] > 0 and s["config"]["model"] == "dsv4-tiny"

        # Poisson arrivals, chat endpoint, prompts from a JSONL file, and the table
        data = tmp_path / "prompts.jsonl"
        data.write_text(
            "\n".join(json.dumps({"prompt": f"question {i}?", "max_tokens": 4}) for i in range(5))
        )
        res = _bench(
            "--url",
            g.url,
            "--endpoint",
            "chat",
            "--dataset",
            str(data),
            "--num-requests",
            "5",
            "--request-rate",
            "20",
            "--no-progress",
        )
        assert res.returncode == 0, res.stderr
        assert "5/5 completed" in res.stdout and "TTFT" in res.stdout and "TPOT" in res.stdout

        # a rate schedule: per-phase summaries and per-request records, phases in order
        records = tmp_path / "records.jsonl"
        res = _bench(
            "--url",
            g.url,
            "--schedule",
            "2s@3,2s@0,1s@6",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--records",
            str(records),
            "--seed",
            "3",
            "--json",
        )
        assert res.returncode == 0, res.stderr
        s = json.loads(res.stdout)
        rows = [json.loads(line) for line in records.read_text().splitlines()]
        assert len(rows) == s["requests"] == sum(p["requests"] for p in s["phases"])
        assert [p["phase"]["rate"] for p in s["phases"]] == [3.0, 0.0, 6.0]
        assert s["phases"][1]["requests"] == 0
        assert all(r["ok"] for r in rows) and s["failed"] == 0
        for r in rows:  # each request was sent inside its phase
            lo, hi = {0: (0.0, 2.0), 2: (4.0, 5.0)}[r["phase"]]
            assert lo <= r["start"] < hi + 0.5, r


def test_bench_flag_errors() -> None:
    res = _bench("--url", "http://127.0.0.1:1", "--model", "m", "--concurrency", "0")
    assert res.returncode == 2 and "--concurrency must be >= 1" in res.stderr
    res = _bench("--url", "http://127.0.0.1:1", "--model", "m", "--dataset", "/nonexistent.jsonl")
    assert res.returncode == 2 and "--dataset" in res.stderr
    res = _bench("--url", "http://127.0.0.1:1", "--model", "m", "--schedule", "60@1")
    assert res.returncode == 2 and "--schedule step '60@1' is not DURATION@RATE" in res.stderr
    res = _bench("--url", "http://127.0.0.1:1", "--model", "m", "--schedule", "5s@0")
    assert res.returncode == 2 and "--schedule produces no request" in res.stderr
