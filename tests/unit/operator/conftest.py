from __future__ import annotations

from typing import Any

import pytest

from dsv4_operator.api.spec import DeploymentSpec, parse


def make_cr(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "serving.dsv4.io/v1alpha1",
        "kind": "DeepSeekV4Deployment",
        "metadata": {"name": "v4", "namespace": "ml", "uid": "uid-1", "generation": 3},
        "spec": {"model": {"path": "/data/v4", "servedName": "deepseek-v4"}, **spec},
    }


@pytest.fixture
def npu_spec() -> DeploymentSpec:
    """2 prefill instances of 2 nodes x 8 NPUs (tp 8, dp 2), 1 decode instance of 1 node."""
    return parse(
        make_cr(
            prefill={"instances": 2, "nodesPerInstance": 2, "parallelism": {"tp": 8, "dp": 2}},
            decode={"instances": 1},
        )
    )


@pytest.fixture
def cpu_spec() -> DeploymentSpec:
    return parse(
        make_cr(
            model={"preset": "dsv4-tiny", "servedName": "tiny"},
            prefill={"npusPerNode": 0, "parallelism": {"tp": 1}},
            decode={"npusPerNode": 0, "parallelism": {"tp": 1}},
            kvTransfer={"transport": "tcp"},
        )
    )


@pytest.fixture
def cpu_cr() -> dict[str, Any]:
    """The CPU deployment as stored in the API (with a uid, as the API server sets it)."""
    return make_cr(
        model={"preset": "dsv4-tiny", "servedName": "tiny"},
        prefill={"npusPerNode": 0, "parallelism": {"tp": 1}},
        decode={"npusPerNode": 0, "parallelism": {"tp": 1}},
        kvTransfer={"transport": "tcp"},
    )
