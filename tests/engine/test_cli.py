"""``dsv4 engine`` accepts the operator's flags and fails fast, clearly, on what it cannot do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dsv4_serving.entrypoints.cli import add_arguments, build_config


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsv4_common.cli", "engine", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_pd_roles_without_a_sidecar_fail_clearly() -> None:
    r = _run("--model", "dsv4-tiny", "--role", "prefill")
    assert r.returncode == 2 and "--role prefill needs --kv-sidecar URL" in r.stderr


def test_an_unreachable_sidecar_fails_the_start_clearly() -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _run("--model", "dsv4-tiny", "--role", "decode", "--kv-sidecar",
             f"http://127.0.0.1:{port}", "--kv-sidecar-wait", "0.3")  # fmt: skip
    assert r.returncode == 2
    assert f"KV sidecar at --kv-sidecar http://127.0.0.1:{port} does not answer" in r.stderr


def test_a_bad_failure_policy_is_refused() -> None:
    r = _run("--model", "dsv4-tiny", "--role", "decode", "--kv-sidecar", "http://x:1",
             "--kv-failure-policy", "retry")  # fmt: skip
    assert r.returncode == 2 and "invalid choice: 'retry'" in r.stderr


def test_parallel_sizes_on_cpu_fail_fast() -> None:
    r = _run("--model", "dsv4-tiny", "--device", "cpu", "--tensor-parallel-size", "2")
    assert r.returncode == 2 and "parallel sizes (2, 1, 1)" in r.stderr


def test_operator_command_line_and_engine_json_build_one_config(tmp_path: Path) -> None:
    import argparse

    cfg_file = tmp_path / "engine.json"
    cfg_file.write_text(json.dumps({
        "deployment": "d", "model": {"dtype": "float32", "maxModelLen": 1024, "servedName": "m"},
        "kvTransfer": {}, "roles": {}, "features": {}, "engine": {"max_num_seqs": 8},
    }))  # fmt: skip
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([
        "--config", str(cfg_file), "--role", "both", "--model", "dsv4-tiny",
        "--served-model-name", "m", "--host", "0.0.0.0", "--port", "8000",
        "--tensor-parallel-size", "1", "--data-parallel-size", "1", "--expert-parallel-size", "1",
        "--num-speculative-tokens", "2", "--device", "cpu",
    ])  # fmt: skip
    c = build_config(args)
    assert (c.model, c.model_name, c.max_model_len, c.dtype, c.max_num_seqs) == (
        "dsv4-tiny", "m", 1024, "float32", 8,
    )  # fmt: skip
    assert c.num_speculative_tokens == 2 and c.device == "cpu"


def test_unknown_model_fails_at_start() -> None:
    r = _run("--model", "/nonexistent/ckpt", "--device", "cpu")
    assert r.returncode != 0 and "neither a directory nor a preset" in (r.stderr + r.stdout)
