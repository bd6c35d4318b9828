"""What the dist tier's process tests share: the live members of a process group (an engine's
front end and its ranks) and a greedy completion's token ids."""

from __future__ import annotations

import time
from pathlib import Path

import httpx


def group_members(pgid: int) -> dict[int, str]:
    """Live (non-zombie) processes of process group ``pgid``: pid -> kernel name."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        state, _ppid, group = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(group) == pgid and state != "Z":
            out[int(d.name)] = name
    return out


def group_left(pgid: int, since: float, within_s: float = 30.0) -> dict[int, str]:
    """The members of ``pgid`` still alive ``within_s`` after the monotonic instant ``since``
    (empty as soon as the group is): a process exits a moment after its parent has, so the
    group is polled up to the bound the instance promises rather than read once."""
    while (left := group_members(pgid)) and time.monotonic() - since < within_s:
        time.sleep(0.2)
    return left


def greedy_tokens(
    url: str, prompt: list[int], max_tokens: int, rank: int | None = None
) -> list[int]:
    """Greedy ``max_tokens`` (ignore_eos) of dsv4-tiny at ``url``, pinned to DP ``rank``."""
    body = {
        "model": "dsv4-tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])
