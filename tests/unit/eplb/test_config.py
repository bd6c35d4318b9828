"""EPLB's engine flags: validated with errors naming the flag, and its stats on /metrics."""

from __future__ import annotations

import pytest

from dsv4_common.cli import build_parser
from dsv4_serving.engine.config import ConfigError, EngineConfig
from dsv4_serving.engine.core.sched.scheduler import SchedulerStats
from dsv4_serving.engine.dp.router import total_stats
from dsv4_serving.entrypoints.metrics import EngineMetrics
from dsv4_serving.eplb.stats import EplbStats
from dsv4_serving.models.config import DeepseekV4Config
from dsv4_serving.presets.configs import preset_config

EP2 = {"data_parallel_size": 2, "expert_parallel_size": 2}


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"enable_eplb": True}, "--enable-eplb needs --expert-parallel-size > 1"),
        ({"eplb_redundant_experts": 2, **EP2}, "--eplb-redundant-experts needs --enable-eplb"),
        (
            {"enable_eplb": True, "eplb_redundant_experts": -1, **EP2},
            "--eplb-redundant-experts must be >= 0",
        ),
        ({"enable_eplb": True, "eplb_interval": 0, **EP2}, "--eplb-interval and --eplb-window"),
        ({"enable_eplb": True, "eplb_window": 0, **EP2}, "--eplb-interval and --eplb-window"),
        (
            {"enable_eplb": True, "emulate_step_time": "20,3,0.2", **EP2},
            "--enable-eplb and --emulate-step-time cannot be combined",
        ),
    ],
)
def test_bad_eplb_settings_are_refused_naming_the_flag(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kw)  # type: ignore[arg-type]


def test_slots_that_do_not_split_over_the_ep_ranks_are_refused() -> None:
    model = DeepseekV4Config.from_dict(preset_config("dsv4-tiny"))  # 8 routed experts
    cfg = EngineConfig(enable_eplb=True, eplb_redundant_experts=3, **EP2)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="8 experts \\+ 3 redundant = 11 slots"):
        cfg.check_parallel("cpu", model)
    EngineConfig(enable_eplb=True, eplb_redundant_experts=2, **EP2).check_parallel("cpu", model)  # type: ignore[arg-type]


def test_the_cli_has_the_eplb_flags() -> None:
    args = build_parser().parse_args(
        ["engine", "--enable-eplb", "--eplb-redundant-experts", "2", "--eplb-interval", "50"]
    )
    assert args.enable_eplb is True and args.eplb_redundant_experts == 2
    assert args.eplb_interval == 50


def _stats(n: int, before: tuple[float, ...], after: tuple[float, ...]) -> SchedulerStats:
    eplb = EplbStats(n, 2 * n, ("layers.0", "mtp.0"), before, after, step=10 * n)
    return SchedulerStats(eplb=eplb)


def test_the_metric_shows_each_layers_imbalance_before_and_after_counted_once() -> None:
    m = EngineMetrics("m")
    s = _stats(1, (2.5, 1.5), (1.1, 1.0))
    m.stats(s, rank=0)
    m.stats(s, rank=1)  # DP rank 1 reports the same re-placement: counted once
    text = m.render().decode()
    assert 'dsv4_eplb_rearrangements_total{model_name="m"} 1.0' in text
    assert 'dsv4_eplb_layers_moved_total{model_name="m"} 2.0' in text
    assert 'dsv4_eplb_imbalance{layer="layers.0",model_name="m",when="before"} 2.5' in text
    assert 'dsv4_eplb_imbalance{layer="mtp.0",model_name="m",when="after"} 1.0' in text
    m.stats(_stats(2, (1.2, 1.1), (1.05, 1.0)), rank=0)
    text = m.render().decode()
    assert 'dsv4_eplb_rearrangements_total{model_name="m"} 2.0' in text
    assert 'dsv4_eplb_imbalance{layer="layers.0",model_name="m",when="before"} 1.2' in text


def test_the_instance_stats_keep_the_ep_groups_eplb_stats() -> None:
    s = _stats(1, (2.0,), (1.0,))
    assert total_stats([s, SchedulerStats(eplb=s.eplb)]).eplb == s.eplb
