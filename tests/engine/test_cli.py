"""``dsv4 engine`` accepts the operator's flags and fails fast, clearly, on what it cannot do."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from dsv4_common.process import dsv4_argv, free_port
from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.entrypoints.cli import add_arguments, build_config


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        dsv4_argv("engine", *args),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_pd_roles_without_a_sidecar_fail_clearly() -> None:
    r = _run("--model", "dsv4-tiny", "--role", "prefill")
    assert r.returncode == 2 and "--role prefill needs --kv-sidecar URL" in r.stderr


def test_an_unreachable_sidecar_fails_the_start_clearly() -> None:
    port = free_port()  # nothing listens on it
    url = f"http://127.0.0.1:{port}"
    r = _run(
        *("--model", "dsv4-tiny", "--role", "decode", "--kv-sidecar-wait", "0.3"),
        *("--kv-sidecar", url),
    )
    assert r.returncode == 2
    assert f"KV sidecar at --kv-sidecar http://127.0.0.1:{port} does not answer" in r.stderr


def test_a_bad_failure_policy_is_refused() -> None:
    r = _run(
        *("--model", "dsv4-tiny", "--role", "decode", "--kv-sidecar", "http://x:1"),
        *("--kv-failure-policy", "retry"),
    )
    assert r.returncode == 2 and "invalid choice: 'retry'" in r.stderr


def test_parallel_sizes_the_model_cannot_split_fail_the_start_clearly() -> None:
    r = _run("--model", "dsv4-tiny", "--device", "cpu", "--tensor-parallel-size", "4")
    assert r.returncode == 1
    assert "failed to start: ConfigError: output groups (o_groups) 2 is not divisible by tp 4" in (
        r.stderr
    )


def test_expert_parallel_sizes_other_than_one_or_the_world_are_refused() -> None:
    r = _run(
        "--model",
        "dsv4-tiny",
        *("--tensor-parallel-size", "2", "--data-parallel-size", "2"),
        "--expert-parallel-size",
        "2",
    )
    assert r.returncode == 2 and "EP spans the DP x TP world" in r.stderr


def _config(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return build_config(p.parse_args(list(argv)))


def test_operator_command_line_and_engine_json_build_one_config(tmp_path: Path) -> None:
    cfg_file = tmp_path / "engine.json"
    cfg_file.write_text(
        json.dumps(
            {
                "dtype": "float32",
                "max_model_len": 1024,
                "served_model_name": "x",
                "max_num_seqs": 8,
                "enable_prefix_caching": False,
            }
        )
    )
    c = _config(
        *("--config", str(cfg_file), "--role", "both", "--model", "dsv4-tiny"),
        *("--served-model-name", "m", "--host", "0.0.0.0", "--port", "8000"),
        *("--tensor-parallel-size", "1", "--data-parallel-size", "1"),
        *("--expert-parallel-size", "1", "--num-speculative-tokens", "2", "--device", "cpu"),
    )
    # the file's values, the flags winning where both give one
    got = (c.model, c.model_name, c.max_model_len, c.dtype, c.max_num_seqs)
    assert got == ("dsv4-tiny", "m", 1024, "float32", 8)
    assert (c.num_speculative_tokens, c.device, c.enable_prefix_caching) == (2, "cpu", False)


def test_unset_flags_keep_the_dataclass_defaults() -> None:
    assert _config("--model", "dsv4-tiny") == EngineConfig(model="dsv4-tiny")


def test_an_unknown_engine_json_key_is_an_error(tmp_path: Path) -> None:
    cfg_file = tmp_path / "engine.json"
    cfg_file.write_text(json.dumps({"model": "dsv4-tiny", "maxModelLen": 1024}))
    r = _run("--config", str(cfg_file))
    assert r.returncode == 2 and "unknown engine config keys: maxModelLen" in r.stderr


def test_the_old_switch_spellings_still_work() -> None:
    c = _config("--no-prefix-caching", "--no-chunked-prefill")
    assert (c.enable_prefix_caching, c.enable_chunked_prefill) == (False, False)
    c = _config("--no-enable-prefix-caching", "--enable-chunked-prefill")
    assert (c.enable_prefix_caching, c.enable_chunked_prefill) == (False, True)


def test_a_bad_dtype_is_refused_by_its_choices() -> None:
    r = _run("--model", "dsv4-tiny", "--dtype", "int3")
    assert r.returncode == 2 and "invalid choice: 'int3'" in r.stderr


def test_unknown_model_fails_at_start() -> None:
    r = _run("--model", "/nonexistent/ckpt", "--device", "cpu")
    assert r.returncode != 0 and "neither a directory nor a preset" in (r.stderr + r.stdout)


def test_a_checkpoint_of_another_architecture_fails_the_start_clearly() -> None:
    r = _run("--model", "dsv3-small", "--device", "cpu", "--architecture", "DeepseekV4ForCausalLM")
    assert r.returncode == 1
    assert (
        "--architecture DeepseekV4ForCausalLM: the checkpoint dsv3-small is DeepseekV3ForCausalLM"
    ) in r.stderr
