"""core/v1 Events about a DeepSeekV4Deployment: what the operator did and phase changes."""

from __future__ import annotations

import datetime
import logging
from typing import Any

from dsv4_operator.api import KIND
from dsv4_operator.kube import KubeApi, KubeError
from dsv4_operator.reconcile import names

log = logging.getLogger("dsv4.operator")


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def post_event(
    kube: KubeApi, body: dict[str, Any], reason: str, message: str, warning: bool = False
) -> None:
    meta = body["metadata"]
    ts = now()
    try:
        kube.create(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                "involvedObject": {
                    "apiVersion": body["apiVersion"],
                    "kind": KIND,
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "uid": meta["uid"],
                },
                "type": "Warning" if warning else "Normal",
                "reason": reason,
                "message": message[:1000],
                "source": {"component": names.MANAGER},
                "firstTimestamp": ts,
                "lastTimestamp": ts,
                "count": 1,
            }
        )
    except KubeError as e:  # events are best effort
        log.warning("could not post event %s: %s", reason, e)
