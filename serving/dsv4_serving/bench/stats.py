"""Per-request records and the summary a serving benchmark reports."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RequestRecord:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    """Seconds from the start of the run to the request's send (its arrival)."""
    phase: int = 0
    """Index of the --schedule phase it arrived in."""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None for single-token answers)."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _dist(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    return {
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def summarize(
    records: list[RequestRecord], duration_s: float, ttft_slo: float | None, tpot_slo: float | None
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    tpots = [t for r in ok if (t := r.tpot) is not None]

    def good(r: RequestRecord) -> bool:
        if ttft_slo is not None and r.ttft > ttft_slo:
            return False
        t = r.tpot
        return not (tpot_slo is not None and t is not None and t > tpot_slo)

    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    d = max(duration_s, 1e-9)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
        "duration_s": duration_s,
        "request_throughput": len(ok) / d,
        "output_token_throughput": out_tokens / d,
        "total_token_throughput": (in_tokens + out_tokens) / d,
        "goodput": sum(1 for r in ok if good(r)) / d,
        "good_requests": sum(1 for r in ok if good(r)),
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "ttft_s": _dist([r.ttft for r in ok]),
        "tpot_s": _dist(tpots),
        "itl_s": _dist([x for r in ok for x in r.itl]),
        "e2e_s": _dist([r.e2e for r in ok]),
        "slo": {"ttft_s": ttft_slo, "tpot_s": tpot_slo},
    }


def phase_summaries(
    records: list[RequestRecord],
    phases: Sequence[Any],
    ttft_slo: float | None,
    tpot_slo: float | None,
) -> list[dict[str, Any]]:
    """The summary of each --schedule phase over the requests that arrived in it, with the SLO
    attainment (share of its requests that completed within both objectives)."""
    out = []
    for i, ph in enumerate(phases):
        mine = [r for r in records if r.phase == i]
        s = summarize(mine, ph.seconds, ttft_slo, tpot_slo)
        s["phase"] = {"index": i, "seconds": ph.seconds, "rate": ph.rate}
        s["slo_attainment"] = s["good_requests"] / len(mine) if mine else math.nan
        out.append(s)
    return out


def write_records(path: Path, records: list[RequestRecord]) -> None:
    with path.open("w") as f:
        for r in records:
            row = {
                "start": r.start,
                "phase": r.phase,
                "ok": r.ok,
                "ttft": r.ttft,
                "e2e": r.e2e,
                "tpot": r.tpot,
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
                "error": r.error,
            }
            f.write(json.dumps(row) + "\n")


def format_table(s: dict[str, Any]) -> str:
    lines = [
        f"{'requests':<28}{s['completed']}/{s['requests']} completed, {s['failed']} failed",
        f"{'duration':<28}{s['duration_s']:.2f} s",
        f"{'request throughput':<28}{s['request_throughput']:.2f} req/s",
        f"{'output token throughput':<28}{s['output_token_throughput']:.1f} tok/s",
        f"{'total token throughput':<28}{s['total_token_throughput']:.1f} tok/s",
    ]
    if s["slo"]["ttft_s"] is not None or s["slo"]["tpot_s"] is not None:
        lines.append(
            f"{'goodput':<28}{s['goodput']:.2f} req/s (TTFT <= {s['slo']['ttft_s']} s, TPOT <= {s['slo']['tpot_s']} s)"
        )
    lines.append(f"\n{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        d = s[key]
        lines.append(
            f"{label:<14}" + "".join(f"{d[k] * 1000:>10.1f}" for k in ("mean", "p50", "p90", "p99"))
        )
    if s["errors"]:
        lines.append("\nerrors: " + "; ".join(s["errors"]))
    for ph in s.get("phases", []):
        p = ph["phase"]
        lines.append(
            f"phase {p['index']} ({p['seconds']:g}s @ {p['rate']:g}/s): "
            f"{ph['completed']}/{ph['requests']} completed, TTFT p90 "
            f"{ph['ttft_s']['p90'] * 1000:.1f} ms, TPOT p90 {ph['tpot_s']['p90'] * 1000:.1f} ms, "
            f"SLO attainment {ph['slo_attainment']:.0%}"
        )
    return "\n".join(lines)
