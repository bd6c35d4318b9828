"""Property-based tests of a live HTTP API from its OpenAPI document (schemathesis + hypothesis):
every operation gets valid and invalid requests; none may get a 5xx, a non-OpenAI error body,
or hang. ``DSV4_FUZZ_EXAMPLES`` sets the examples per operation and mode (``scripts/fuzz``
raises it for the long run); CI keeps the default small."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import hypothesis
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import GenerationMode

EXAMPLES = int(os.environ.get("DSV4_FUZZ_EXAMPLES", "12"))
SEED = int(os.environ.get("DSV4_FUZZ_SEED", "0"))
TIMEOUT_S = 60.0  # a request that takes longer counts as a hang


@dataclass
class FuzzReport:
    tried: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, set[int]] = field(default_factory=dict)

    def __str__(self) -> str:
        return "\n".join(
            f"{op}: {n} examples, statuses {sorted(self.statuses[op])}"
            for op, n in sorted(self.tried.items())
        )


def fuzz_openapi(
    base_url: str, examples: int = EXAMPLES, skip: frozenset[str] = frozenset()
) -> FuzzReport:
    """Fuzz every operation of ``{base_url}/openapi.json`` except those in ``skip`` ("GET
    /metrics"); raises on the first request that breaks a rule (hypothesis shrinks it)."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    report = FuzzReport()
    for result in schema.get_all_operations():
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        if label in skip:
            continue
        report.tried[label] = 0
        report.statuses[label] = set()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(op, mode, label, base_url, examples, report)
    return report


def _fuzz_operation(
    op: schemathesis.APIOperation,
    mode: GenerationMode,
    label: str,
    base_url: str,
    examples: int,
    report: FuzzReport,
) -> None:
    @hypothesis.settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis.seed(SEED)
    @hypothesis.given(case=op.as_strategy(generation_mode=mode))
    def one(case: schemathesis.Case) -> None:
        t = time.monotonic()
        response = case.call(base_url=base_url, timeout=TIMEOUT_S)
        took = time.monotonic() - t
        report.tried[label] += 1
        report.statuses[label].add(response.status_code)
        where = f"{case.as_curl_command()}\n-> {response.status_code} {response.text[:300]}"
        assert response.status_code < 500, where
        assert took < TIMEOUT_S, where
        if response.status_code >= 400 and response.status_code not in (404, 405):
            error = response.json()["error"]
            assert isinstance(error["message"], str) and error["message"], where

    try:
        one()
    except hypothesis.errors.Unsatisfiable:
        if mode is GenerationMode.POSITIVE:
            raise
        # an operation without parameters or body has no invalid request to make
