"""Each image runs its own commands: `dsv4 ... --help` in a pod on the real node, from the
image built from docker/*.Dockerfile (a CLI that imports what its image lacks fails here)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.node.conftest import REAL_NODE_SELECTOR, apply

COMMANDS = [
    ("engine", []),
    ("engine", ["engine"]),
    ("engine", ["kv-sidecar"]),
    ("operator", ["operator"]),
    ("operator", ["gateway"]),
]


def _help_pod(name: str, image: str, args: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": REAL_NODE_SELECTOR,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "Never",
                    # the images' own entrypoints (the engine's sources CANN's env first)
                    "args": ["dsv4", *args, "--help"]
                    if image.startswith("dsv4.local/engine")
                    else [*args, "--help"],
                }
            ],
        },
    }


@pytest.mark.parametrize(("image", "args"), COMMANDS, ids=lambda v: str(v))
def test_help_runs_in_the_image_meant_for_it(
    real_cluster: Any, real_namespace: str, app_images: dict[str, str], image: str, args: list[str]
) -> None:
    name = "help-" + ("-".join(args) or "dsv4")
    pod = _help_pod(name, app_images[image], args)
    pod["metadata"]["namespace"] = real_namespace
    apply(real_cluster, pod)
    deadline = time.monotonic() + 120
    phase = ""
    while phase not in ("Succeeded", "Failed"):
        assert time.monotonic() < deadline, f"{name} still {phase!r}"
        time.sleep(0.5)
        status = json.loads(
            real_cluster.kubectl("get", "pod", name, "-n", real_namespace, "-o", "json")
        )["status"]
        phase = status.get("phase", "")
    logs = real_cluster.kubectl("logs", "-n", real_namespace, name)
    assert phase == "Succeeded", logs
    assert "usage: dsv4" in logs, logs
