"""What the dist tier's process tests share: the live members of a process group (an engine's
front end and its ranks) and a greedy completion's token ids."""

from __future__ import annotations

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
