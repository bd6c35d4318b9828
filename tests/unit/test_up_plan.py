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
