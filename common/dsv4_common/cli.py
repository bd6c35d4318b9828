"""The ``dsv4`` command, above every package: it names each subcommand's module as a string and
imports it only when that subcommand runs, so ``dsv4 operator`` never loads torch, ``dsv4 --help``
is instant, and no package has to import another to be reachable from one command."""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

# name -> (module with add_arguments(parser) and run(args) -> int, help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "operator": (
        "dsv4_operator.cli",
        "run the DeepSeekV4Deployment operator against the current cluster",
    ),
    "dev-cluster": (
        "dsv4_devcluster.cli",
        "run a local Kubernetes control plane (real binaries) with fake Ascend nodes",
    ),
    "gateway": (
        "dsv4_serving.gateway.cli",
        "run the OpenAI-compatible gateway (PD orchestration, DPLB routing)",
    ),
    "kv-sidecar": (
        "dsv4_kvtransfer.cli",
        "run the KV-transfer sidecar beside an engine (staging region, leases, peer pulls)",
    ),
    "up": (
        "dsv4_serving.commands.up",
        "run the local stack (gateway, prefill and decode engines with KV sidecars) until Ctrl-C",
    ),
    "bench": (
        "dsv4_serving.bench.cli",
        "load an OpenAI-compatible server; report TTFT, TPOT, ITL, E2E, throughput, goodput",
    ),
    "trace": (
        "dsv4_serving.commands.trace",
        "show where one request's time went: its trace (gateway, prefill, KV, decode) as a "
        "text waterfall",
    ),
    "explain-model": (
        "dsv4_serving.commands.explain_model",
        "show which model class, device, attention backend and switches a checkpoint selects",
    ),
    "engine": (
        "dsv4_serving.entrypoints.cli",
        "serve a model over the OpenAI API (continuous batching, paged KV, prefix cache, MTP)",
    ),
}


def _version() -> str:
    try:
        return version("dsv4")
    except PackageNotFoundError:
        return "unknown"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or (``only``) just one subcommand's flags: a command imports no
    other subcommand's module, so an image that lacks one package (the engine image has no
    ``cryptography`` for the dev cluster) still runs every command it ships."""
    parser = argparse.ArgumentParser(prog="dsv4", description=__doc__, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"dsv4 {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        p.set_defaults(_module=module)
        if only in (None, name):
            importlib.import_module(module).add_arguments(p)
    return parser


def _subcommand(argv: list[str]) -> str:
    """The subcommand named on the command line ("" when none: ``dsv4 --help``)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in SUBCOMMANDS else ""
    return ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_subcommand(argv)).parse_args(argv)
    return int(importlib.import_module(args._module).run(args))


if __name__ == "__main__":
    sys.exit(main())
