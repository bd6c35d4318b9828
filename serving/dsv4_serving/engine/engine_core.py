"""The engine core: scheduler + KV cache manager + model runner, stepped in a loop.

``EngineCore`` is usable in-process (tests, benchmarks); ``run_engine_core`` is the body of the
engine-core process the HTTP front end starts, so the front end never waits on compute. Messages
in: ``("add", EngineCoreRequest)``, ``("abort", [ids])``, ``("shutdown", None)``. Messages out:
``("ready", EngineInfo)``, ``("outputs", [EngineCoreOutput], SchedulerStats)``,
``("error", text)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any

from dsv4_serving.engine.config import ConfigError, EngineConfig
from dsv4_serving.engine.kv_cache_manager import KVCacheManager
from dsv4_serving.engine.kv_connector.compat import KVCompat
from dsv4_serving.engine.kv_connector.scheduler_side import SidecarConnectorScheduler
from dsv4_serving.engine.kv_connector.validation import check_kv_request
from dsv4_serving.engine.request import EngineCoreOutput, EngineCoreRequest, Request
from dsv4_serving.engine.scheduler import Scheduler, SchedulerConfig, SchedulerStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineInfo:
    """What the front end needs to know about the core (sent once, when ready)."""

    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    block_size: int
    num_kv_blocks: int
    num_speculative_tokens: int
    architecture: str
    kv_dtype: str = "float32"


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        from dsv4_serving.engine.kv_connector.worker_side import SidecarConnectorWorker
        from dsv4_serving.engine.model_loader import load_model, num_kv_blocks
        from dsv4_serving.engine.model_runner import ModelRunner

        if config.role != "both" and not config.kv_sidecar:
            raise ConfigError(f"role {config.role!r} needs --kv-sidecar URL (the local sidecar)")
        self.config = config
        lm = load_model(config)
        k = config.num_speculative_tokens
        if k < 0:
            k = 1 if lm.num_mtp_layers else 0
        if k and not lm.num_mtp_layers:
            raise ConfigError("num_speculative_tokens > 0 needs a model with an MTP layer")
        has_state = bool(lm.model.cache_class.bytes_per_slot(lm.model_config, 1))
        caching = config.enable_prefix_caching
        snaps = (config.num_prefix_state_snapshots or 2 * config.max_num_seqs) if caching else 0
        num_slots = config.max_num_seqs + (snaps if has_state else 0)
        n_blocks = num_kv_blocks(config, lm, num_slots, k)
        per_req = -(-(lm.max_model_len + k) // lm.block_size)
        if n_blocks < per_req:
            raise ConfigError(
                f"{n_blocks} KV blocks of {lm.block_size} tokens cannot hold one request of "
                f"max_model_len {lm.max_model_len}; lower max_model_len or add blocks"
            )
        self.kv = KVCacheManager(
            n_blocks, lm.block_size, config.max_num_seqs, caching, has_state, snaps,
            key_next_token=k > 0,
        )  # fmt: skip
        self.kv_scheduler: SidecarConnectorScheduler | None = None
        if config.kv_sidecar:
            self.kv_scheduler = SidecarConnectorScheduler(config.kv_failure_policy)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=lm.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                num_speculative_tokens=k,
            ),
            self.kv,
            self.kv_scheduler,
        )
        self.runner = ModelRunner(lm, n_blocks, self.kv.num_slots, k, config.seed)
        self.kv_worker: Any = None  # SidecarConnectorWorker (imports torch)
        if config.kv_sidecar and self.kv_scheduler is not None:
            self.kv_worker = SidecarConnectorWorker(
                config.kv_sidecar,
                KVCompat(lm.hf_config["architectures"][0], lm.block_size, k,
                         str(lm.dtype).removeprefix("torch.")),
                self.kv_scheduler.stats,
                config.kv_pull_timeout,
            )  # fmt: skip
            self.kv_worker.register_kv_caches(self.runner.cache)
        eos = lm.model_config.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        self.info = EngineInfo(
            max_model_len=lm.max_model_len,
            vocab_size=int(lm.model_config.vocab_size),
            eos_token_id=self.eos_token_id,
            block_size=lm.block_size,
            num_kv_blocks=n_blocks,
            num_speculative_tokens=k,
            architecture=lm.hf_config["architectures"][0],
            kv_dtype=str(lm.dtype).removeprefix("torch."),
        )

    def add_request(self, req: EngineCoreRequest) -> None:
        n = len(req.prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.info.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens; this model's maximum context length is "
                f"{self.info.max_model_len} (prompt and output)"
            )
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.info.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.info.vocab_size}): {bad[:5]}")
        p = req.kv_transfer_params
        if p and (p.get("do_remote_decode") or p.get("do_remote_prefill")):
            check_kv_request(self.config.role, self.kv_worker is not None, p)
            if p.get("do_remote_decode"):
                # the export is the prompt's KV: the prefill stops at the first token
                sp = req.sampling_params
                req.sampling_params = replace(sp, max_tokens=1, min_tokens=min(sp.min_tokens, 1))
        self.scheduler.add_request(Request(req, self.eos_token_id))

    last_step_idle = False

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        aborted = self.scheduler.abort_requests(request_ids)
        if self.kv_worker is not None:
            self._sync_kv(self.kv_worker)  # their pulls let go now, not at the next step
        return aborted

    def kv_housekeeping(self) -> None:
        """An idle engine still finishes what its pulls left (cancelled ones release)."""
        if self.kv_worker is not None:
            self._sync_kv(self.kv_worker)
            self.scheduler.update_from_connector(self.kv_worker.get_finished())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        w = self.kv_worker
        if w is not None:
            self._sync_kv(w)  # cancels of aborted loads first, then what finished
            self.scheduler.update_from_connector(w.get_finished())
        out = self.scheduler.schedule()
        if w is not None:
            self._sync_kv(w)  # start the pulls of requests parked just now
        results = self.runner.execute(out)
        outputs = self.scheduler.update_from_output(out, results)
        if w is not None and self.kv_scheduler is not None:
            saves = self.kv_scheduler.take_saves()
            if saves:
                self.scheduler.saves_done(w.save_kv(saves), outputs)
            self.last_step_idle = not out.scheduled and not outputs
        return outputs

    def _sync_kv(self, w: Any) -> None:
        assert self.kv_scheduler is not None
        w.start_load_kv(self.kv_scheduler.build_connector_meta())

    def wait_for_kv(self, timeout_s: float) -> None:
        """Nothing ran last step (every request waits for its KV): sleep until a pull ends."""
        if self.kv_worker is not None:
            self.kv_worker.wait_for_event(timeout_s)

    def close(self) -> None:
        if self.kv_worker is not None:
            self.kv_worker.close()

    def stats(self) -> SchedulerStats:
        return self.scheduler.snapshot_stats()


def run_engine_core(config: EngineConfig, in_q: Any, out_q: Any) -> None:
    """Body of the engine-core process."""
    logging.basicConfig(level=os.environ.get("DSV4_LOG_LEVEL", "INFO"))
    parent = os.getppid()
    try:
        core = EngineCore(config)
    except Exception as exc:
        out_q.put(("error", f"{type(exc).__name__}: {exc}"))
        log.debug("engine core failed to start:\n%s", traceback.format_exc())
        return
    out_q.put(("ready", core.info))
    try:
        _loop(core, in_q, out_q, parent)
    finally:
        core.close()


def _loop(core: EngineCore, in_q: Any, out_q: Any, parent: int) -> None:
    stats_due = True
    while True:
        msgs = []
        if not core.has_unfinished_requests():
            with contextlib.suppress(queue.Empty):  # idle: block briefly, do not spin
                msgs.append(in_q.get(timeout=0.5))
        while True:
            try:
                msgs.append(in_q.get_nowait())
            except queue.Empty:
                break
        for kind, payload in msgs:
            if kind == "shutdown":
                return
            if kind == "add":
                try:
                    core.add_request(payload)
                except ValueError as exc:
                    out_q.put(("reject", payload.request_id, str(exc)))
            elif kind == "abort":
                core.abort_requests(payload)
            stats_due = True
        if core.has_unfinished_requests():
            t = time.perf_counter()
            outputs = core.step()
            log.debug("step %.1f ms, %d outputs", 1e3 * (time.perf_counter() - t), len(outputs))
            if core.last_step_idle and not stats_due:
                core.wait_for_kv(0.02)  # only parked requests: no busy loop, no message flood
                continue
            out_q.put(("outputs", outputs, core.stats()))
            stats_due = False
        else:
            core.kv_housekeeping()
            if stats_due:
                out_q.put(("outputs", [], core.stats()))
                stats_due = False
            elif os.getppid() != parent:
                return  # the front end died without telling us
