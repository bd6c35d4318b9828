"""The engine config validates its parallel sizes as a topology, without loading torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dsv4_serving.engine.config import ConfigError, EngineConfig
from dsv4_serving.models.config import DeepseekV3Config, DeepseekV4Config
from dsv4_serving.presets.configs import preset_config


def test_ep_that_is_neither_one_nor_the_world_is_refused_at_construction() -> None:
    with pytest.raises(ConfigError, match="must be 1 or tp x dp = 4: EP spans the DP x TP world"):
        EngineConfig(tensor_parallel_size=2, data_parallel_size=2, expert_parallel_size=2)


def test_a_model_that_cannot_split_is_named() -> None:
    cfg = DeepseekV4Config.from_dict(preset_config("dsv4-tiny"))
    with pytest.raises(
        ConfigError, match="output groups \\(o_groups\\) 2 is not divisible by tp 4"
    ):
        EngineConfig(tensor_parallel_size=4).check_parallel("cpu", cfg)
    EngineConfig(tensor_parallel_size=2, expert_parallel_size=2).check_parallel("cpu", cfg)
    EngineConfig().check_parallel("cpu", cfg)


def test_pd_roles_with_several_ranks_are_accepted() -> None:
    # KV moves per rank (tests/pd/test_pd_parallel.py): TP and DP instances may take PD roles
    for tp, dp in ((2, 1), (1, 2)):
        EngineConfig(
            tensor_parallel_size=tp,
            data_parallel_size=dp,
            role="decode",
            kv_sidecar="http://127.0.0.1:14580",
        ).check_parallel("cpu")


def test_threads_per_rank_default_splits_the_cpus_over_the_ranks() -> None:
    assert EngineConfig().rank_threads(16) == 0  # one process: torch's own default
    assert EngineConfig(tensor_parallel_size=2).rank_threads(16) == 8
    assert EngineConfig(tensor_parallel_size=2).rank_threads(1) == 1
    assert EngineConfig(tensor_parallel_size=2, threads_per_rank=3).rank_threads(16) == 3
    # 4 ranks over 2 nodes: each node's 2 ranks share its CPUs
    tp2dp2 = EngineConfig(tensor_parallel_size=2, data_parallel_size=2, expert_parallel_size=4)
    assert tp2dp2.rank_threads(16) == 4
    assert tp2dp2.rank_threads(16, local_ranks=2) == 8
    with pytest.raises(ConfigError, match="threads_per_rank must be >= 0"):
        EngineConfig(threads_per_rank=-1)


def test_the_rendezvous_timeout_defaults_to_the_distributed_timeout() -> None:
    assert EngineConfig().rendezvous_timeout == 0.0
    assert EngineConfig(rendezvous_timeout=1800).rendezvous_timeout == 1800
    with pytest.raises(ConfigError, match=r"rendezvous_timeout must be >= 0 \(0: distributed"):
        EngineConfig(rendezvous_timeout=-1)


def test_validating_parallel_sizes_never_imports_torch() -> None:
    code = (
        "import sys; from dsv4_serving.engine.config import EngineConfig; "
        "EngineConfig(tensor_parallel_size=2, expert_parallel_size=2).topology(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_context_parallel_sizes_the_world_and_refuses_what_it_cannot_run_yet() -> None:
    cfg = EngineConfig(tensor_parallel_size=2, context_parallel_size=2)
    assert cfg.topology().world == 4
    assert cfg.topology().cp_groups() == [[0, 2], [1, 3]]
    # world = tp x cp x dp, MTP drafts beside CP
    big = EngineConfig(
        tensor_parallel_size=2,
        context_parallel_size=2,
        data_parallel_size=2,
        num_speculative_tokens=1,
    )
    assert big.topology().world == 8
    assert big.topology().cp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert big.topology().dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for kwargs, what in (
        ({"emulate_step_time": "1,0,0"}, "--emulate-step-time"),
        ({"role": "decode", "kv_sidecar": "http://127.0.0.1:1"}, "--role decode"),
    ):
        with pytest.raises(
            ConfigError, match=f"--context-parallel-size 2 cannot be combined with {what}"
        ):
            EngineConfig(context_parallel_size=2, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="context_parallel_size must be >= 1"):
        EngineConfig(context_parallel_size=0)


def test_context_parallel_takes_v4_and_v3_models() -> None:
    v3 = DeepseekV3Config.from_dict(preset_config("dsv3-small"))
    EngineConfig(context_parallel_size=2, tensor_parallel_size=2).check_parallel("cpu", v3)
    v4 = DeepseekV4Config.from_dict(preset_config("dsv4-tiny"))
    EngineConfig(context_parallel_size=2, tensor_parallel_size=2).check_parallel("cpu", v4)


def test_the_cp_flag_and_its_short_spelling_set_the_field() -> None:
    from dsv4_common.cli import build_parser
    from dsv4_serving.entrypoints.cli import build_config

    for argv in (["--context-parallel-size", "2"], ["-cp", "2"]):
        args = build_parser("engine").parse_args(["engine", "--model", "dsv4-tiny", *argv])
        assert build_config(args).context_parallel_size == 2
