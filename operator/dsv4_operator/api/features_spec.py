"""The deployment's ``features`` section: EPLB, the host's hccn.conf, and switches kept at
their defaults until an engine acts on them."""

from __future__ import annotations

from dataclasses import dataclass

from dsv4_operator.api.fields import crd_object, not_yet, prop, section
from dsv4_operator.api.schema import boolean, integer, string


@crd_object(
    rules=[
        (
            "self.enabled || self.redundantExperts == 0",
            "features.eplb.redundantExperts needs features.eplb.enabled",
        )
    ],
    defaulted=True,
    description="Expert-parallel load balancing (EPLB, docs/eplb.md).",
)
@dataclass(frozen=True, kw_only=True)
class EplbSpec:
    enabled: bool = prop(
        boolean(
            "Expert-parallel load balancing: engines count each MoE layer's expert "
            "load and every intervalSteps re-place experts over their EP ranks, "
            "live (needs expert parallelism > 1 on both roles).",
            default=False,
        )
    )
    redundant_experts: int = prop(
        integer(
            "Extra physical expert slots per MoE layer (in total over an "
            "instance's EP ranks) for replicas of hot experts; routed experts + "
            "redundant must split evenly over the EP ranks.",
            default=0,
            minimum=0,
            maximum=64,
        )
    )
    interval_steps: int = prop(
        integer("Forward steps between expert re-placements.", default=600, minimum=1)
    )
    window_steps: int = prop(
        integer(
            "The last this many forward steps' expert load decide a re-placement.",
            default=600,
            minimum=1,
        )
    )


@crd_object(
    rules=[
        (
            "self.hostPath.matches('^(/[-_.a-zA-Z0-9]+)*/hccn[.]conf$') && "
            "!self.hostPath.contains('/../')",
            "features.hccnConf.hostPath must be an absolute path to a file named "
            "hccn.conf (no '..')",
        )
    ],
    defaulted=True,
)
@dataclass(frozen=True, kw_only=True)
class HccnConfSpec:
    enabled: bool = prop(boolean("Mount the host's hccn.conf (NPU network config).", default=True))
    host_path: str = prop(
        string(
            "Where hccn.conf is on the node (a file of that name: anyone who may "
            "create the CR chooses it, so it cannot name any other file).",
            default="/etc/hccn.conf",
            max_length=256,
        )
    )


@crd_object(
    rules=[
        (
            "self.mlapo",
            not_yet("features.mlapo", "the engine has no switch for it", "remove it or set true"),
        ),
        (
            "self.c8 == 'auto'",
            not_yet("features.c8", "the engine has no switch for it", "remove it or set auto"),
        ),
    ],
    defaulted=True,
)
@dataclass(frozen=True, kw_only=True)
class FeaturesSpec:
    """``eplb`` becomes the engines' EPLB settings (engine.json); ``mlapo`` and ``c8`` are
    accepted by the CRD only at their defaults (no engine acts on them yet); ``hccn_conf`` and
    ``privileged`` shape the engine pods."""

    eplb: EplbSpec = section(EplbSpec)
    mlapo: bool = prop(
        boolean(
            "Fused MLA preprocessing kernels (on Ascend). Not supported yet: must be true "
            "(the default).",
            default=True,
        )
    )
    c8: str = prop(
        string(
            "8-bit KV block mode for sparse attention. Not supported yet: must be auto.",
            default="auto",
            enum=["auto", "on", "off"],
        )
    )
    hccn_conf: HccnConfSpec = section(HccnConfSpec)
    privileged: bool = prop(boolean("Run engine containers privileged (opt-in).", default=False))
