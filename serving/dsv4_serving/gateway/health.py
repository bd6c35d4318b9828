"""Health checks and load scraping: eject instances that stop answering, re-admit them when they
answer again, and read each engine's own view of its load from /metrics."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from dsv4_serving.gateway.instances import Instance, InstancePool
from dsv4_serving.gateway.metrics import GatewayMetrics

log = logging.getLogger("dsv4.gateway")

_SCRAPED = {
    "vllm:num_requests_waiting": "waiting",
    "dsv4_kv_requests_waiting_for_remote_kv": "waiting_for_kv",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prefix_cache_hits_total": "cached_tokens",
}


def apply_scrape(inst: Instance, text: str) -> None:
    """Copy the engine's load gauges onto the instance; the ``engine`` label is the DP rank."""
    seen: dict[tuple[int, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            attr = _SCRAPED.get(sample.name)
            if attr is None:
                continue
            try:
                rank = int(sample.labels.get("engine", "0"))
            except ValueError:
                rank = 0
            if 0 <= rank < inst.dp_size:
                seen[(rank, attr)] = seen.get((rank, attr), 0.0) + float(sample.value)
    for (rank, attr), value in seen.items():
        setattr(inst.ranks[rank], attr, value)


def mark_failure(inst: Instance, pool_metrics: GatewayMetrics, eject_after: int) -> None:
    inst.failures += 1
    if inst.healthy and inst.failures >= eject_after:
        inst.healthy = False
        pool_metrics.ejections.labels(inst.url).inc()
        log.warning("ejected %s (%s) after %d failures", inst.url, inst.role, inst.failures)


def mark_success(inst: Instance) -> None:
    if not inst.healthy:
        log.info("re-admitted %s (%s)", inst.url, inst.role)
    inst.failures = 0
    inst.healthy = True


_PROBE = aiohttp.ClientTimeout(total=2.0)


async def check_once(
    client: aiohttp.ClientSession, inst: Instance, metrics: GatewayMetrics, eject_after: int
) -> None:
    try:
        async with client.get(f"{inst.url}/health", timeout=_PROBE) as resp:
            ok = resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        ok = False
    if not ok:
        mark_failure(inst, metrics, eject_after)
        return
    mark_success(inst)
    if inst.draining:  # back when it is ready again (a restarted process on the same address)
        try:
            async with client.get(f"{inst.url}/ready", timeout=_PROBE) as resp:
                inst.draining = resp.status != 200
        except (aiohttp.ClientError, TimeoutError):
            pass
    try:
        async with client.get(f"{inst.url}/metrics", timeout=_PROBE) as resp:
            if resp.status == 200:
                apply_scrape(inst, await resp.text())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        pass  # load figures are a hint; health is what counts


async def health_loop(
    client: aiohttp.ClientSession,
    pool: InstancePool,
    metrics: GatewayMetrics,
    interval_s: float,
    eject_after: int,
) -> None:
    while True:
        try:
            instances = pool.all()
            await asyncio.gather(*(check_once(client, i, metrics, eject_after) for i in instances))
            for role in ("prefill", "decode", "both"):
                metrics.healthy.labels(role).set(len(pool.of_role(role)))
        except Exception:  # the loop must outlive any one bad answer, or nobody is re-admitted
            log.exception("health check round failed")
        await asyncio.sleep(interval_s)
