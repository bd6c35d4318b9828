"""Run a command inside its CPU share: ``python -m dsv4_serving.platform.share_exec --cpus 0-1
--env OMP_NUM_THREADS=2 -- <argv>`` pins itself, sets the environment and execs ``argv``, so
the share holds from the command's first instruction (its children inherit it), and a restart
with the same command line gets the same share. ``taskset`` and ``env`` in one, with no
dependency on either being installed."""

from __future__ import annotations

import argparse
import os
import sys

from dsv4_serving.platform.threads import ProcessShare, cpu_list, parse_cpu_list


def wrap(argv: list[str], share: ProcessShare) -> list[str]:
    """``argv`` run inside ``share`` (as it is when the share sets nothing)."""
    if share.cpus is None and not share.env:
        return argv
    head = [sys.executable, "-m", "dsv4_serving.platform.share_exec"]
    if share.cpus is not None:
        head += ["--cpus", cpu_list(share.cpus)]
    for key, value in share.env.items():
        head += ["--env", f"{key}={value}"]
    return [*head, "--", *argv]


def main(args: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="share_exec", description=__doc__)
    p.add_argument("--cpus", type=parse_cpu_list, default=None, help="CPU list, e.g. 0-1,4")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    ns = p.parse_args(args)
    argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
    if not argv:
        p.error("no command to run (after --)")
    if ns.cpus is not None:
        os.sched_setaffinity(0, ns.cpus)
    env = dict(os.environ)
    for item in ns.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--env wants KEY=VALUE, got {item!r}")
        env[key] = value
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    main()
