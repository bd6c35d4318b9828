"""Send the workload: streamed OpenAI requests at a fixed concurrency or a Poisson rate."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from dsv4_serving.bench.stats import RequestRecord
from dsv4_serving.gateway.lifecycle import carries_text

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "it",
    "an",
    "be",
    "this",
    "which",
    "or",
    "are",
]


@dataclass(frozen=True)
class Prompt:
    body: dict[str, Any]
    prompt_tokens: int


def random_prompts(
    n: int, input_len: int, input_range: float, output_len: int, seed: int, chat: bool, model: str
) -> list[Prompt]:
    """Random word prompts of about ``input_len`` tokens (+-``input_range`` fraction)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lo, hi = (
            max(1, int(input_len * (1 - input_range))),
            max(1, int(input_len * (1 + input_range))),
        )
        words = [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]
        # a distinct head per request so prefix caches do not make every request a hit
        text = f"{i} " + " ".join(words)
        out.append(_prompt(text, output_len, chat, model, len(words) + 1))
    return out


def jsonl_prompts(
    path: Path, n: int | None, output_len: int, chat: bool, model: str
) -> list[Prompt]:
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text = row["prompt"] if isinstance(row, dict) else str(row)
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path}:{lineno}: each line must be a JSON object with a 'prompt' ({e})"
            ) from None
        max_tokens = int(row.get("max_tokens", output_len)) if isinstance(row, dict) else output_len
        out.append(_prompt(str(text), max_tokens, chat, model, len(str(text).split())))
        if n is not None and len(out) >= n:
            break
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def _prompt(text: str, max_tokens: int, chat: bool, model: str, approx_tokens: int) -> Prompt:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return Prompt(body, approx_tokens)


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of an event stream: only CR LF, LF or CR end a line (the SSE grammar). Not
    ``aiter_lines``, which also splits at U+0085, U+2028 and U+2029, characters a completion
    may hold and the server sends unescaped (JSON with ensure_ascii=False)."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        *lines, buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if buf:
        yield buf.decode("utf-8", errors="replace")


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: Prompt, headers: dict[str, str], timeout_s: float
) -> RequestRecord:
    rec = RequestRecord(prompt_tokens=prompt.prompt_tokens)
    start = time.perf_counter()
    last: float | None = None
    chunks = 0
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, json=prompt.body, headers=headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    rec.error = f"HTTP {resp.status_code}: {text[:200]}"
                    return rec
                async for line in sse_lines(resp.aiter_bytes()):
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        rec.error = str(event["error"].get("message", event["error"]))[:200]
                        return rec
                    usage = event.get("usage")
                    if usage:
                        rec.prompt_tokens = int(usage.get("prompt_tokens", rec.prompt_tokens))
                        rec.output_tokens = int(usage.get("completion_tokens", rec.output_tokens))
                    # a token, as the gateway's histograms count one (an empty text in an
                    # unfinished choice too: a token whose bytes do not make a character yet);
                    # counting only non-empty texts merged those gaps, and ITL p90 doubled
                    if carries_text(data.encode()):
                        now = time.perf_counter()
                        if last is None:
                            rec.ttft = now - start
                        else:
                            rec.itl.append(now - last)
                        last = now
                        chunks += 1
    except TimeoutError:
        rec.error = f"timed out after {timeout_s} s"
        return rec
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    rec.e2e = time.perf_counter() - start
    if rec.output_tokens == 0:
        rec.output_tokens = chunks  # no usage chunk: one token per chunk
    rec.ok = last is not None
    if not rec.ok:
        rec.error = "no tokens in the answer"
    return rec


class Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.failed, self.enabled = total, 0, 0, enabled
        self.start = time.perf_counter()

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if self.enabled:
            width = 30
            filled = width * self.done // max(1, self.total)
            rate = self.done / max(1e-9, time.perf_counter() - self.start)
            sys.stderr.write(
                f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {rate:.1f} req/s, {self.failed} failed"
            )
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def run_load(
    url: str,
    prompts: list[Prompt],
    headers: dict[str, str],
    concurrency: int | None,
    rate: float | None,
    seed: int,
    timeout_s: float,
    progress: bool,
    schedule: list[tuple[float, int]] | None = None,
) -> tuple[list[RequestRecord], float]:
    """All prompts, at most ``concurrency`` at once, arriving as a Poisson process of ``rate``/s,
    at the ``schedule``'s (time, phase) arrivals (one per prompt), or all at once. Returns the
    records (each with its send time and phase) and the wall time."""
    limits = httpx.Limits(
        max_connections=concurrency or len(prompts),
        max_keepalive_connections=concurrency or len(prompts),
    )
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency or len(prompts))
    bar = Progress(len(prompts), progress)
    records: list[RequestRecord] = [RequestRecord() for _ in prompts]
    async with httpx.AsyncClient(
        limits=limits, timeout=httpx.Timeout(timeout_s, connect=10.0)
    ) as client:

        async def send(i: int, p: Prompt, phase: int) -> None:
            async with gate:
                sent = time.perf_counter() - start
                records[i] = await one_request(client, url, p, headers, timeout_s)
            records[i].start, records[i].phase = sent, phase
            bar.update(records[i].ok)

        start = time.perf_counter()
        tasks = []
        for i, p in enumerate(prompts):
            if schedule is not None:
                await asyncio.sleep(max(0.0, start + schedule[i][0] - time.perf_counter()))
            tasks.append(asyncio.create_task(send(i, p, schedule[i][1] if schedule else 0)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        return records, time.perf_counter() - start
