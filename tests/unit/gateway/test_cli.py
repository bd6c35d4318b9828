"""``dsv4 gateway``'s flags come from ``GatewayConfig``: every flag that worked before still
does, the environment fills what the flags leave, and bad values are named by their flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dsv4_serving.gateway.cli import add_arguments, config
from dsv4_serving.gateway.config import GatewayConfig


def _config(*argv: str, env: dict[str, str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config(p.parse_args(argv), env or {})


def test_the_historic_flags_build_the_config() -> None:
    argv = (
        "--prefill http://p0:8000 --prefill http://p1:8000 --decode http://d0:8000"
        " --policy least_load --prefill-timeout 5 --first-byte-timeout 6 --stream-idle-timeout 7"
        " --health-interval 0.5 --max-inflight 3 --retries 0 --selective-pd-tokens 64"
        " --block-size 128 --served-model-name v4 --log-level warning"
    )
    cfg = _config(*argv.split())
    assert cfg == GatewayConfig(
        prefill_urls=["http://p0:8000", "http://p1:8000"],
        decode_urls=["http://d0:8000"],
        policy="least_load",
        prefill_timeout_s=5.0,
        first_byte_timeout_s=6.0,
        stream_idle_timeout_s=7.0,
        health_interval_s=0.5,
        max_inflight=3,
        retries=0,
        selective_pd_tokens=64,
        block_size=128,
        served_model_name="v4",
        log_level="warning",
    )


def test_unset_flags_keep_the_config_defaults() -> None:
    assert _config("--engine", "http://e:1") == GatewayConfig(both_urls=["http://e:1"])


def test_the_environment_gives_namespace_and_api_key_and_the_key_file_wins(tmp_path: Path) -> None:
    env = {"POD_NAMESPACE": "ml", "DSV4_GATEWAY_API_KEY": "from-env"}
    cfg = _config("--discovery", "kubernetes", env=env)
    assert (cfg.namespace, cfg.api_key) == ("ml", "from-env")
    key = tmp_path / "key"
    key.write_text("from-file\n")
    cfg = _config(
        "--discovery", "kubernetes", "--namespace", "x", "--api-key-file", str(key), env=env
    )
    assert (cfg.namespace, cfg.api_key) == ("x", "from-file")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill", "http://p:1"], "--prefill and --decode"),
        (["--engine", "e:1"], "http:// or https://"),
        (["--engine", "http://e:1", "--port", "0"], "--port"),
        (["--engine", "http://e:1", "--prefill-timeout", "0"], "--prefill-timeout-s must be > 0"),
        (["--engine", "http://e:1", "--tokenizer", "/nonexistent.json"], "--tokenizer"),
        (["--engine", "http://e:1", "--api-key-file", "/nonexistent"], "--api-key-file"),
    ],
)
def test_bad_values_are_named_by_their_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(*argv)
