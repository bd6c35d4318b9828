from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_common.cli import SUBCOMMANDS, build_parser, main

REPO = Path(__file__).resolve().parents[2]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_subcommand_has_a_description_and_every_flag_a_help_text() -> None:
    subs = _subparsers(build_parser())
    assert set(subs) == set(SUBCOMMANDS)
    undocumented = []
    for name, sub in subs.items():
        assert sub.description == SUBCOMMANDS[name][1]
        help_text = sub.format_help()
        assert help_text.startswith(f"usage: dsv4 {name}")
        for action in sub._actions:
            if action.option_strings and not (action.help or "").strip():
                undocumented.append(f"dsv4 {name} {action.option_strings[0]}")
    assert not undocumented, f"flags without help: {undocumented}"


def test_console_script_lists_subcommands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dsv4_common.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in SUBCOMMANDS:
        assert name in out


def test_unknown_flag_is_named_in_the_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["dev-cluster", "--nodez", "3"])
    assert exc.value.code == 2
    assert "--nodez" in capsys.readouterr().err


def test_negative_node_count_is_rejected() -> None:
    with pytest.raises(SystemExit, match="--nodes must be >= 0"):
        main(["dev-cluster", "--nodes", "-1"])


def test_repo_root_does_not_shadow_stdlib_operator() -> None:
    # `python -m ...` from the repo root puts it on sys.path; operator/ must not become a package.
    assert not (REPO / "operator" / "__init__.py").exists()
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            "import operator, sys; print(operator.__file__); operator.add(1, 2)",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert str(REPO / "operator") not in res.stdout


@pytest.mark.parametrize(
    ("argv", "absent"),
    [
        (["--help"], ["dsv4_operator", "dsv4_serving", "dsv4_kvtransfer"]),
        (["kv-sidecar", "--help"], ["dsv4_operator", "dsv4_serving", "cryptography", "torch"]),
        (["engine", "--help"], ["dsv4_operator", "cryptography", "torch"]),
        (["gateway", "--help"], ["dsv4_devcluster", "cryptography", "torch"]),
    ],
)
def test_a_command_imports_only_what_it_needs(argv: list[str], absent: list[str]) -> None:
    # an image built with one extra (the engine image: `.[serving]`) must run its commands
    code = (
        "import sys\n"
        "from dsv4_common.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split("\n")[-2]
    loaded = set(out.split())
    assert not [m for m in absent if m in loaded or any(x.startswith(m + ".") for x in loaded)]


def test_abbreviated_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # argparse would read --max-num-se as --max-num-seqs: an engineArgs entry could then set a
    # flag the operator owns under another spelling
    with pytest.raises(SystemExit):
        build_parser("engine").parse_args(["engine", "--max-num-se", "4"])
    assert "unrecognized arguments: --max-num-se" in capsys.readouterr().err
