"""Command lines built from config dataclasses: one declaration per setting."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

import pytest

from dsv4_common.config_cli import add_config_arguments, config_from_args, field_docs

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Demo:
    name: str = "x"
    """What it is called."""
    mode: Literal["fast", "slow"] = "fast"
    """How it runs."""
    count: int = 3
    """How many, at most 50%."""
    ratio: float = 0.5
    url: str | None = None
    """Where it is."""
    enabled: bool = True
    """Whether it runs."""
    secret: bytes = b""

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="demo", exit_on_error=False)
    add_config_arguments(p, Demo, exclude=["secret"], aliases={"count": ["-n"]})
    return p


def test_field_docstrings_become_help() -> None:
    assert field_docs(Demo) == {
        "name": "What it is called.",
        "mode": "How it runs.",
        "count": "How many, at most 50%.",
        "url": "Where it is.",
        "enabled": "Whether it runs.",
    }
    text = _parser().format_help()
    assert "How many, at most 50%. (default: 3)" in " ".join(text.split())
    assert "{fast,slow}" in text
    assert "--no-enabled" in text
    assert "--secret" not in text


def test_unset_flags_keep_the_base_and_set_flags_win() -> None:
    args = _parser().parse_args(["--mode", "slow", "-n", "7", "--no-enabled", "--url", "http://h"])
    cfg = config_from_args(Demo, args, base={"name": "from-file", "count": 1}, secret=b"k")
    assert cfg == Demo(
        name="from-file", mode="slow", count=7, url="http://h", enabled=False, secret=b"k"
    )
    assert config_from_args(Demo, _parser().parse_args([])) == Demo()


def test_choices_and_types_are_enforced_by_the_parser() -> None:
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        _parser().parse_args(["--mode", "medium"])
    with pytest.raises(argparse.ArgumentError, match="invalid int value"):
        _parser().parse_args(["--count", "many"])


def test_validation_stays_in_post_init() -> None:
    with pytest.raises(ValueError, match="count must be >= 0, got -1"):
        config_from_args(Demo, _parser().parse_args(["--count", "-1"]))


def test_a_field_type_without_a_flag_form_is_refused_loudly() -> None:
    with pytest.raises(TypeError, match=r"Demo\.secret"):
        add_config_arguments(argparse.ArgumentParser(), Demo)
