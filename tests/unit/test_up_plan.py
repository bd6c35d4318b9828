"""``dsv4 up``'s engine counts: what each flag starts, and the flags it refuses by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4_common.cli import build_parser, main
from dsv4_serving.commands import up


def _plan(tmp_path: Path, *argv: str) -> list[str]:
    args = build_parser().parse_args(["up", "--port", "18000", *argv])
    up.check_counts(args)
    return [c.name for c in up.plan(args, tmp_path)]


def test_default_is_one_prefill_and_one_decode_pair(tmp_path: Path) -> None:
    names = _plan(tmp_path)
    assert [n for n in names if not n.endswith("sidecar")] == ["prefill-0", "decode-0", "gateway"]


def test_no_pd_decode_n_starts_n_engines_behind_the_gateway(tmp_path: Path) -> None:
    args = build_parser().parse_args(["up", "--no-pd", "--decode", "2"])
    children = up.plan(args, tmp_path)
    assert [c.name for c in children] == ["engine-0", "engine-1", "gateway"]
    gateway = children[-1].argv
    engines = [gateway[i + 1] for i, a in enumerate(gateway) if a == "--engine"]
    assert engines == [children[0].url, children[1].url] and len(set(engines)) == 2
    assert _plan(tmp_path, "--no-pd") == ["engine-0", "gateway"]


def test_the_gateway_renders_chats_as_the_engines_do(tmp_path: Path) -> None:
    argv = ["up", "--engine-arg=--default-thinking", "--engine-arg=off"]
    gateway = up.plan(build_parser().parse_args(argv), tmp_path)[-1].argv
    i = gateway.index("--tokenizer")
    assert gateway[i : i + 4] == ["--tokenizer", "dsv4-tiny", "--default-thinking", "off"]


def test_no_pd_refuses_prefill_by_name() -> None:
    with pytest.raises(SystemExit, match="--prefill has no meaning with --no-pd"):
        main(["up", "--no-pd", "--prefill", "1"])


@pytest.mark.parametrize("flag", ["--prefill", "--decode"])
def test_counts_below_one_are_refused_by_name(flag: str) -> None:
    with pytest.raises(SystemExit, match=f"{flag} must be >= 1, got 0"):
        main(["up", flag, "0"])


def test_role_args_reach_their_role_only(tmp_path: Path) -> None:
    argv = ["up", "--engine-arg=--seed=3", "--prefill-arg=--tensor-parallel-size=2"]
    children = {c.name: c.argv for c in up.plan(build_parser().parse_args(argv), tmp_path)}
    prefill, decode = children["prefill-0"], children["decode-0"]
    assert prefill[-2:] == ["--seed=3", "--tensor-parallel-size=2"]
    assert "--tensor-parallel-size=2" not in decode and decode[-1] == "--seed=3"
    argv = ["up", "--no-pd", "--decode-arg=--num-speculative-tokens=0"]
    children = {c.name: c.argv for c in up.plan(build_parser().parse_args(argv), tmp_path)}
    assert children["engine-0"][-1] == "--num-speculative-tokens=0"


def test_no_pd_refuses_prefill_args_by_name() -> None:
    with pytest.raises(SystemExit, match="--prefill-arg has no meaning with --no-pd"):
        main(["up", "--no-pd", "--prefill-arg=--seed=1"])


def test_the_sidecar_tiers_reach_every_sidecar(tmp_path: Path) -> None:
    argv = ["up", "--kv-host-bytes", "64M", "--kv-disk-bytes", "1G"]
    args = build_parser().parse_args(argv)
    up.check_tiers(args)
    sidecars = [c for c in up.plan(args, tmp_path) if c.name.endswith("sidecar")]
    assert len(sidecars) == 2
    for c in sidecars:
        name = c.name.removesuffix("-sidecar")
        i = c.argv.index("--kv-host-bytes")
        assert c.argv[i : i + 2] == ["--kv-host-bytes", str(64 << 20)]
        i = c.argv.index("--kv-disk-bytes")
        assert c.argv[i : i + 4] == [
            "--kv-disk-bytes",
            str(1 << 30),
            "--kv-disk-dir",
            str(tmp_path / f"{name}-kv-disk"),
        ]
    plain = up.plan(build_parser().parse_args(["up"]), tmp_path)
    assert all("--kv-host-bytes" not in c.argv and "--kv-disk-dir" not in c.argv for c in plain)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--no-pd", "--kv-host-bytes", "1M"], "--kv-host-bytes has no meaning with --no-pd"),
        (["--kv-host-bytes", "1G"], "--kv-host-bytes must be at most the sidecars' staging"),
        (["--kv-host-bytes", "1M", "--kv-disk-bytes", "1K"], "--kv-disk-bytes must be 0 (off)"),
        (["--kv-disk-bytes", "1G"], "--kv-disk-bytes needs --kv-host-bytes"),
    ],
)
def test_bad_tiers_are_refused_by_name(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        up.check_tiers(build_parser().parse_args(["up", *argv]))


def test_a_negative_tier_is_not_a_size() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--kv-disk-bytes=-1G"])
