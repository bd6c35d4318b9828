"""``SidecarConfig`` and the ``dsv4 kv-sidecar`` command line built from it: the flags the
operator and ``dsv4 up`` pass land in the right settings, derived defaults follow the peer port
and the pod, and a setting out of range is refused by the config itself."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from dsv4_common.config_cli import config_from_args, given
from dsv4_common.ports import SIDECAR_CONTROL_OFFSET
from dsv4_common.process import dsv4_argv
from dsv4_kvtransfer import cli
from dsv4_kvtransfer.config import SidecarConfig
from dsv4_kvtransfer.launch import sidecar_argv

TOKEN = b"0123456789abcdef0123"


def parse(argv: list[str], env: dict[str, str] | None = None) -> SidecarConfig:
    """What ``run`` builds from these flags (the token already read)."""
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(argv)
    base = cli.derived_defaults(given(SidecarConfig, args), env or {"POD_NAME": "pod-0"})
    return config_from_args(SidecarConfig, args, base=base, token=TOKEN)


def test_the_operators_and_dsv4_ups_flags_land_in_their_settings() -> None:
    cfg = parse(
        [
            "--transport",
            "shm",
            "--host",
            "127.0.0.1",
            "--port",
            "15000",
            "--control-port",
            "15001",
            "--metrics-port",
            "15002",
            "--metrics-host",
            "127.0.0.1",
            "--engine-url",
            "http://127.0.0.1:8000",
            "--lease-seconds",
            "12",
            "--auth-token-file",
            "/t",
            "--shm-name",
            "dsv4-up-1-p",
            "--staging-bytes",
            "268435456",
            "--advertise-host",
            "10.1.2.3",
            "--send-rate",
            "8M",
            "--max-frame-bytes",
            "1M",
            "--streams",
            "2",
            "--min-stream-bytes",
            "4M",
            "--pull-timeout",
            "9",
            "--max-concurrent-pulls",
            "3",
            "--ready-file",
            "/r",
            "--log-level",
            "warning",
            "--control-socket",
            "/s",
            "--sidecar-id",
            "a",
            "--engine-id",
            "b",
        ]
    )
    assert cfg == SidecarConfig(
        token=TOKEN,
        transport="shm",
        host="127.0.0.1",
        port=15000,
        advertise_host="10.1.2.3",
        control_port=15001,
        control_socket="/s",
        metrics_port=15002,
        metrics_host="127.0.0.1",
        engine_url="http://127.0.0.1:8000",
        lease_seconds=12.0,
        staging_bytes=256 << 20,
        shm_name="dsv4-up-1-p",
        streams=2,
        min_stream_bytes=4 << 20,
        max_frame_bytes=1 << 20,
        max_concurrent_pulls=3,
        pull_timeout_s=9.0,
        send_rate=8 << 20,
        sidecar_id="a",
        engine_id="b",
        ready_file="/r",
        log_level="warning",
    )


def test_unset_ports_names_and_address_follow_the_peer_port_and_the_pod() -> None:
    cfg = parse(["--port", "16000"], {"POD_NAME": "decode-1", "POD_IP": "10.0.0.7"})
    assert cfg.control_port == 16000 + SIDECAR_CONTROL_OFFSET
    assert cfg.metrics_port is None  # off unless asked for
    assert (cfg.shm_name, cfg.advertise_host) == ("dsv4-kv-16000", "10.0.0.7")
    assert (cfg.sidecar_id, cfg.engine_id) == ("decode-1", "decode-1")
    # no pod IP: a specific bind address is what peers reach; a wildcard one is not
    assert parse(["--host", "10.9.9.9"]).advertise_host == "10.9.9.9"
    assert parse([]).advertise_host == "127.0.0.1"
    assert parse(["--port", "0"]).control_port == 0  # any port, as the peer port


def test_sidecar_argv_round_trips_through_the_command_line() -> None:
    argv = sidecar_argv("/tok", port=0, staging_bytes="48M", lease_seconds=2.0, metrics_port=None)
    assert argv == dsv4_argv(
        "kv-sidecar",
        "--auth-token-file",
        "/tok",
        "--port",
        "0",
        "--staging-bytes",
        "48M",
        "--lease-seconds",
        "2.0",
    )  # the None setting left out
    cfg = parse(argv[argv.index("kv-sidecar") + 1 :])
    assert (cfg.port, cfg.staging_bytes, cfg.lease_seconds) == (0, 48 << 20, 2.0)
    with pytest.raises(TypeError, match="not SidecarConfig settings: lease"):
        sidecar_argv("/tok", lease=2.0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lease_seconds": 0}, "lease_seconds must be in (0, 3600], not 0"),
        ({"lease_seconds": 4000}, "lease_seconds must be in (0, 3600]"),
        ({"streams": 0}, "streams must be >= 1, not 0"),
        ({"max_concurrent_pulls": 0}, "max_concurrent_pulls must be >= 1"),
        ({"max_connections": 0}, "max_connections must be >= 1"),
        ({"max_frame_bytes": 1024}, "max_frame_bytes must be at least 4096"),
        ({"pull_timeout_s": 0}, "pull_timeout_s must be > 0"),
        ({"send_rate": -1}, "send_rate must be >= 0"),
        ({"port": 70000}, "port must be a port number (0-65535), not 70000"),
        ({"metrics_port": -1}, "metrics_port must be a port number"),
    ],
)
def test_a_setting_out_of_range_is_refused_by_the_config(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as e:
        SidecarConfig(token=TOKEN, **change)
    assert str(e.value).startswith(message)


def test_every_flag_has_help_from_the_field_docstring() -> None:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    flags = {a.option_strings[0]: a.help for a in p._actions if a.option_strings}
    assert all(flags.values()), [f for f, h in flags.items() if not h]
    assert flags["--lease-seconds"] == (
        "How long an export waits for its pull, and pulled KV for the engine to take it. "
        "(default: 30.0)"
    )
    assert "--token" not in flags  # read from --auth-token-file, never a flag
