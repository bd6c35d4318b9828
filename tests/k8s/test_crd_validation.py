"""The API server itself rejects bad DeepSeekV4Deployments, with messages a person understands."""

from __future__ import annotations

import copy
import json
import subprocess
from typing import Any

import pytest


def _cr(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "apiVersion": "serving.dsv4.io/v1alpha1",
        "kind": "DeepSeekV4Deployment",
        "metadata": {"name": "v4", "namespace": "default"},
        "spec": {"model": {"path": "/data/v4", "servedName": "v4"}},
    }
    base["spec"].update(spec)
    return base


def _apply(cluster: Any, obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(cluster.config.bin_dir / "kubectl"),
            "--kubeconfig",
            str(cluster.kubeconfig),
            "apply",
            "--dry-run=server",
            "-f",
            "-",
        ],
        input=json.dumps(obj),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _named(name: str) -> dict[str, Any]:
    cr = _cr()
    cr["metadata"]["name"] = name
    return cr


def _without_model() -> dict[str, Any]:
    cr = _cr()
    del cr["spec"]["model"]
    return cr


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("no model", _without_model(), "spec.model: Required value"),
    (
        "shm size not a quantity",
        _cr(prefill={"shmSize": "1GB"}),
        "prefill.shmSize must be a Kubernetes quantity such as 1Gi or 512Mi",
    ),
    (
        "shm size too small for staging and engine",
        _cr(decode={"shmSize": "256Mi"}),
        "decode.shmSize must be at least 320Mi",
    ),
    (
        "two model sources",
        _cr(model={"path": "/data/v4", "preset": "dsv4-tiny", "servedName": "v4"}),
        "set exactly one of path, pvc or preset",
    ),
    ("relative model path", _cr(model={"path": "data/v4", "servedName": "v4"}), "spec.model.path"),
    (
        "ranks do not match NPUs",
        _cr(prefill={"nodesPerInstance": 2, "parallelism": {"tp": 8}}),
        "prefill: parallelism.tp * parallelism.cp * parallelism.dp must equal nodesPerInstance "
        "* npusPerNode",
    ),
    (
        "decode TP larger than prefill TP",
        _cr(prefill={"npusPerNode": 4, "parallelism": {"tp": 4}}),
        "prefill.parallelism.tp must be >= decode.parallelism.tp and a multiple of it",
    ),
    (
        "prefill TP not a multiple of decode TP",
        _cr(decode={"npusPerNode": 6, "parallelism": {"tp": 6}}),
        "prefill.parallelism.tp must be >= decode.parallelism.tp and a multiple of it",
    ),
    (
        "EP neither 1 nor TP*DP",
        _cr(prefill={"nodesPerInstance": 2, "parallelism": {"tp": 8, "dp": 2, "ep": 8}}),
        "parallelism.ep must be 1 (every rank holds every expert) or tp * dp",
    ),
    (
        "CPU ranks that do not split evenly over the pods",
        _cr(
            prefill={"npusPerNode": 0, "nodesPerInstance": 2, "parallelism": {"tp": 3}},
            decode={"npusPerNode": 0, "parallelism": {"tp": 1}},
            kvTransfer={"transport": "tcp"},
        ),
        "prefill: on CPU (npusPerNode 0) parallelism.tp * parallelism.cp * parallelism.dp must "
        "be a multiple of nodesPerInstance",
    ),
    (
        "HCCL without NPUs",
        _cr(
            prefill={"npusPerNode": 0, "parallelism": {"tp": 1}},
            decode={"npusPerNode": 0, "parallelism": {"tp": 1}},
        ),
        "kvTransfer.transport hccl needs NPUs on both roles",
    ),
    ("unknown transport", _cr(kvTransfer={"transport": "udp"}), 'Unsupported value: "udp"'),
    (
        "too many MTP tokens",
        _cr(decode={"mtpTokens": 5}),
        "spec.decode.mtpTokens: Invalid value: 5: spec.decode.mtpTokens in body should be less than or equal to 3",
    ),
    (
        "negative instances",
        _cr(prefill={"instances": -1}),
        "spec.prefill.instances in body should be greater than or equal to 0",
    ),
    (
        "autoscaling min above max",
        _cr(autoscaling={"decode": {"min": 5, "max": 2}}),
        "autoscaling.decode: min must be <= max",
    ),
    (
        "malformed NPU resource",
        _cr(scheduling={"npuResourceName": "Ascend 910"}),
        "spec.scheduling.npuResourceName",
    ),
    (
        "grace period shorter than the preStop pause and the exit margin",
        _cr(decode={"terminationGracePeriodSeconds": 5}),
        "spec.decode.terminationGracePeriodSeconds in body should be greater than or equal to 10",
    ),
    (
        "a rollout that could replace no instance",
        _cr(decode={"rollout": {"maxSurge": 0, "maxUnavailable": 0}}),
        "rollout: maxSurge and maxUnavailable cannot both be 0",
    ),
    (
        "environment variable name Kubernetes refuses",
        _cr(prefill={"env": {"1BAD": "x"}}),
        "prefill.env: variable names must be letters, digits",
    ),
    (
        "engineArgs overriding the role",
        _cr(decode={"engineArgs": ["--max-num-seqs=8", "--role=prefill"]}),
        "decode.engineArgs: --role=prefill sets what the operator sets from the deployment",
    ),
    (
        "engineArgs abbreviating an owned flag",
        _cr(prefill={"engineArgs": ["--kv-side", "http://elsewhere"]}),
        "prefill.engineArgs: --kv-side sets what the operator sets",
    ),
    ("unknown preset", _cr(model={"preset": "dsv4-huge", "servedName": "v4"}), "dsv4-huge"),
    (
        "zero TPOT target",
        _cr(autoscaling={"tpotSeconds": 0}),
        "autoscaling.tpotSeconds must be a positive number of seconds",
    ),
    (
        "negative TTFT target",
        _cr(autoscaling={"ttftSeconds": -1}),
        "autoscaling.ttftSeconds must be a positive number of seconds",
    ),
    (
        "resource amount not a quantity",
        _cr(prefill={"resources": {"requests": {"cpu": "lots"}}}),
        "each resource amount must be a Kubernetes quantity",
    ),
    (
        "sidecar resource amount not a quantity",
        _cr(kvTransfer={"sidecarResources": {"limits": {"memory": "2GB"}}}),
        "each resource amount must be a Kubernetes quantity",
    ),
    (
        "hccn.conf path naming another host file",
        _cr(features={"hccnConf": {"hostPath": "/etc/shadow"}}),
        "features.hccnConf.hostPath must be an absolute path to a file named hccn.conf",
    ),
    (
        "hccn.conf path climbing out",
        _cr(features={"hccnConf": {"hostPath": "/etc/../root/hccn.conf"}}),
        "features.hccnConf.hostPath must be an absolute path to a file named hccn.conf",
    ),
    ("name starting with a digit", _named("4v"), "metadata.name must be a DNS label"),
    ("name too long", _named("v" * 41), "at most 40 characters"),
    ("misspelt field", _cr(prefil={"instances": 2}), 'unknown field "spec.prefil"'),
    # no knob without behaviour: accepted only at their defaults until something acts on them
    (
        "autoscaling from Prometheus without its URL",
        _cr(autoscaling={"enabled": True, "metrics": {"source": "Prometheus"}}),
        "autoscaling.metrics.prometheusURL is required when source is Prometheus",
    ),
    (
        "autoscaling KV target above 1",
        _cr(autoscaling={"decode": {"kvCacheTarget": 1.5}}),
        "autoscaling.decode.kvCacheTarget must be in (0, 1]",
    ),
    (
        "autoscaling prefill capacity zero",
        _cr(autoscaling={"prefill": {"tokensPerSecond": 0}}),
        "autoscaling.prefill.tokensPerSecond must be positive",
    ),
    (
        "autoscaling prefill queue zero",
        _cr(autoscaling={"prefill": {"waitingPerInstance": 0}}),
        "autoscaling.prefill.waitingPerInstance must be positive",
    ),
    (
        "prompt deadline zero",
        _cr(autoscaling={"prefill": {"promptDeadlineSeconds": 0}}),
        "autoscaling.prefill.promptDeadlineSeconds must be positive",
    ),
    (
        "prompt deadline past the TTFT objective",
        _cr(autoscaling={"ttftSeconds": 1, "prefill": {"promptDeadlineSeconds": 1.5}}),
        "autoscaling.prefill.promptDeadlineSeconds must not exceed ttftSeconds",
    ),
    (
        "autoscaling ratio inverted",
        _cr(autoscaling={"prefillDecodeRatio": {"min": 2, "max": 1}}),
        "autoscaling.prefillDecodeRatio needs 0 < min <= max",
    ),
    (
        "scheduled minimum ending when it starts",
        _cr(
            autoscaling={
                "scheduledMinimums": [
                    {"name": "peak", "start": "09:00", "end": "09:00:00", "prefill": 2}
                ]
            }
        ),
        "autoscaling.scheduledMinimums: a window's start and end must differ",
    ),
    (
        "scheduled minimum raising no role",
        _cr(autoscaling={"scheduledMinimums": [{"name": "p", "start": "09:00", "end": "10:00"}]}),
        "autoscaling.scheduledMinimums: a window raises prefill, decode or both",
    ),
    (
        "scheduled minimum above max",
        _cr(
            autoscaling={
                "decode": {"max": 2},
                "scheduledMinimums": [{"name": "p", "start": "09:00", "end": "10:00", "decode": 3}],
            }
        ),
        "a window's prefill and decode must not exceed autoscaling.prefill.max and "
        "autoscaling.decode.max",
    ),
    (
        "scheduled minimum with an external scaler",
        _cr(
            autoscaling={
                "mode": "External",
                "scheduledMinimums": [{"name": "p", "start": "09:00", "end": "10:00", "decode": 1}],
            }
        ),
        "autoscaling.scheduledMinimums needs mode Builtin",
    ),
    (
        "scheduled minimum at 24:00",
        _cr(
            autoscaling={
                "scheduledMinimums": [{"name": "p", "start": "22:00", "end": "24:00", "decode": 1}]
            }
        ),
        "spec.autoscaling.scheduledMinimums[0].end in body should match",
    ),
    (
        "two scheduled minimums with one name",
        _cr(
            autoscaling={
                "scheduledMinimums": [
                    {"name": "p", "start": "09:00", "end": "10:00", "decode": 1},
                    {"name": "p", "start": "11:00", "end": "12:00", "decode": 1},
                ]
            }
        ),
        "Duplicate value",
    ),
    (
        "autoscaling with LeaderWorkerSet",
        _cr(autoscaling={"enabled": True}, scheduling={"workload": "LeaderWorkerSet"}),
        "autoscaling with scheduling.workload LeaderWorkerSet is not supported yet",
    ),
    (
        "autoscaling interval zero",
        _cr(autoscaling={"intervalSeconds": 0}),
        "spec.autoscaling.intervalSeconds: Invalid value: 0",
    ),
    (
        "EPLB on a role without expert parallelism",
        _cr(features={"eplb": {"enabled": True}}, decode={"parallelism": {"ep": 1}}),
        "features.eplb needs expert parallelism > 1 on both roles",
    ),
    (
        "EPLB redundant experts without EPLB",
        _cr(features={"eplb": {"redundantExperts": 16}}),
        "features.eplb.redundantExperts needs features.eplb.enabled",
    ),
    (
        "MLAPO off",
        _cr(features={"mlapo": False}),
        "features.mlapo is not supported yet",
    ),
    ("C8 on", _cr(features={"c8": "on"}), "features.c8 is not supported yet"),
    (
        "negative host tier",
        _cr(kvCache={"hostBytes": "-1Gi"}),
        "kvCache.hostBytes must be a Kubernetes quantity such as 4Gi (0: off)",
    ),
    (
        "negative disk tier",
        _cr(kvCache={"hostBytes": "1Gi", "diskBytes": "-20Gi"}),
        "kvCache.diskBytes must be 0 (off) or a Kubernetes quantity of at least 1Mi",
    ),
    (
        "disk tier too small",
        _cr(kvCache={"hostBytes": "1Gi", "diskBytes": "1k"}),
        "kvCache.diskBytes must be 0 (off) or a Kubernetes quantity of at least 1Mi",
    ),
    (
        "disk tier not a quantity",
        _cr(kvCache={"hostBytes": "1Gi", "diskBytes": "20GB"}),
        "kvCache.diskBytes must be 0 (off) or a Kubernetes quantity of at least 1Mi",
    ),
    (
        "disk tier without a host tier",
        _cr(kvCache={"diskBytes": "20Gi"}),
        "kvCache.diskBytes needs kvCache.hostBytes",
    ),
    (
        "unknown weight format",
        _cr(model={"path": "/data/v4", "servedName": "v4", "quantization": "int4"}),
        'spec.model.quantization: Unsupported value: "int4"',
    ),
]


@pytest.mark.parametrize(("case", "obj", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_deployment_is_rejected(
    k8s_control_plane, dsv4_crd, case: str, obj: dict[str, Any], message: str
) -> None:
    res = _apply(k8s_control_plane, copy.deepcopy(obj))
    assert res.returncode != 0, f"{case}: accepted"
    assert message in res.stderr, res.stderr


def test_knobs_at_their_defaults_or_acted_on_are_accepted(k8s_control_plane, dsv4_crd) -> None:
    cr = _cr(
        prefill={
            "engineArgs": ["--max-num-seqs=64", "--enable-prefix-caching", "-x", "--"],
            "env": {"HCCL_BUFFSIZE": "400", "my.var-1": "x"},
            "resources": {"requests": {"cpu": 4, "memory": "64Gi"}, "limits": {"cpu": "500m"}},
        },
        autoscaling={
            "enabled": True,
            "intervalSeconds": 5,
            "metrics": {"source": "Prometheus", "prometheusURL": "http://prom.monitoring:9090"},
            "prefill": {"min": 1, "max": 2, "tokensPerSecond": 20000, "promptDeadlineSeconds": 1},
            "decode": {"min": 1, "max": 8, "kvCacheTarget": 0.9},
            "prefillDecodeRatio": {"min": 0.25, "max": 1},
            "scheduledMinimums": [
                {
                    "name": "business",
                    "start": "08:45",
                    "end": "18:00",
                    "days": ["Mon", "Fri"],
                    "prefill": 2,
                    "decode": 4,
                },
                {"name": "night-batch", "start": "23:30:00", "end": "01:00", "decode": 8},
            ],
        },
        features={
            "eplb": {"enabled": True, "redundantExperts": 16, "intervalSteps": 100},
            "mlapo": True,
            "c8": "auto",
            "hccnConf": {"hostPath": "/opt/npu-1.2/hccn.conf"},
        },
        model={"path": "/data/v4", "servedName": "v4", "quantization": "none"},
        kvCache={"hostBytes": "4Gi", "diskBytes": "20Gi"},
    )
    res = _apply(k8s_control_plane, cr)
    assert res.returncode == 0, res.stderr


def test_cpu_instances_may_run_several_ranks_per_pod(k8s_control_plane, dsv4_crd) -> None:
    """On CPU the ranks are processes on the pod's CPUs: tp/dp need not equal the pod count."""
    cr = _cr(
        prefill={"npusPerNode": 0, "parallelism": {"tp": 2}},
        decode={"npusPerNode": 0, "nodesPerInstance": 2, "parallelism": {"tp": 2, "dp": 2}},
        kvTransfer={"transport": "tcp"},
    )
    res = _apply(k8s_control_plane, cr)
    assert res.returncode == 0, res.stderr
    one = _cr(
        prefill={"npusPerNode": 0, "parallelism": {"tp": 2, "dp": 2, "ep": 1}},
        decode={"npusPerNode": 0, "nodesPerInstance": 2, "parallelism": {"tp": 2}},
        kvTransfer={"transport": "tcp"},
    )
    res = _apply(k8s_control_plane, one)
    assert res.returncode == 0, res.stderr


def test_valid_examples_are_accepted(k8s_control_plane, dsv4_crd) -> None:
    from pathlib import Path

    for path in sorted(
        (Path(__file__).resolve().parents[2] / "manifests" / "examples").glob("*.yaml")
    ):
        res = subprocess.run(
            [
                str(k8s_control_plane.config.bin_dir / "kubectl"),
                "--kubeconfig",
                str(k8s_control_plane.kubeconfig),
                "apply",
                "--dry-run=server",
                "-n",
                "default",
                "-f",
                str(path),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, f"{path.name}: {res.stderr}"


def test_context_parallel_is_a_prefill_knob_with_its_rules(k8s_control_plane, dsv4_crd) -> None:
    """``parallelism.cp``: ranks = tp x cp x dp; refused on decode, with MTP, DP, EP or -cp."""
    cpu = {"npusPerNode": 0, "mtpTokens": 0}
    tcp = {"transport": "tcp"}
    dec = {"npusPerNode": 0, "parallelism": {"tp": 1}}  # prefill TP >= decode TP
    ok = [
        _cr(prefill={**cpu, "parallelism": {"tp": 1, "cp": 2}}, decode=dec, kvTransfer=tcp),
        # MTP and DP compose with CP (the engine's CP x DP and CP + MTP are exact)
        _cr(
            prefill={**cpu, "mtpTokens": 1, "parallelism": {"tp": 1, "cp": 2, "dp": 2}},
            decode=dec,
            kvTransfer=tcp,
        ),
        _cr(
            prefill={"npusPerNode": 8, "mtpTokens": 0, "parallelism": {"tp": 4, "cp": 2}},
            decode={"parallelism": {"tp": 4, "dp": 2}},  # prefill TP >= decode TP
        ),
    ]
    for cr in ok:
        res = _apply(k8s_control_plane, cr)
        assert res.returncode == 0, res.stderr
    bad = [
        (
            _cr(decode={"parallelism": {"tp": 8, "cp": 2}}),
            "decode.parallelism.cp must be 1: context parallel is for prefill",
        ),
        (
            _cr(
                prefill={**cpu, "parallelism": {"tp": 1, "cp": 2, "dp": 2, "ep": 2}},
                decode=dec,
                kvTransfer=tcp,
            ),
            "parallelism.cp > 1 needs ep 1",
        ),
        (
            _cr(prefill={"npusPerNode": 8, "mtpTokens": 0, "parallelism": {"tp": 8, "cp": 2}}),
            "prefill: parallelism.tp * parallelism.cp * parallelism.dp must equal",
        ),
        (
            _cr(
                prefill={**cpu, "parallelism": {"tp": 1}, "engineArgs": ["-cp", "2"]},
                decode=dec,
                kvTransfer=tcp,
            ),
            "prefill.engineArgs: -cp sets what the operator sets from the deployment",
        ),
    ]
    for cr, message in bad:
        res = _apply(k8s_control_plane, cr)
        assert res.returncode != 0 and message in res.stderr, res.stderr
