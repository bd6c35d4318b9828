"""The engine core: scheduler + KV cache manager + model runner, stepped in a loop.

``EngineCore`` is usable in-process (tests, benchmarks); ``run_engine_core`` is the body of the
engine-core process the HTTP front end starts, so the front end never waits on compute. The
messages between the two are ``messages.py``'s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from dsv4_common import tracing
from dsv4_kvtransfer.integrity import config_hash
from dsv4_kvtransfer.pd_protocol import PrefillRequestParams, RemotePrefillParams
from dsv4_serving.distributed.groups import SINGLE, SOLO, Group, ModelParallel
from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.core.kv_cache_manager import KVCacheManager
from dsv4_serving.engine.core.sched.async_scheduler import AsyncScheduler
from dsv4_serving.engine.core.sched.scheduler import (
    RunnerResult,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)
from dsv4_serving.engine.engine.drain import Migrations
from dsv4_serving.engine.engine.messages import (
    EngineInfo,
)
from dsv4_serving.engine.engine.request_tracing import CoreTracing
from dsv4_serving.engine.kv_connector.compat import KVCompat
from dsv4_serving.engine.kv_connector.scheduler_side import SidecarConnectorScheduler
from dsv4_serving.engine.kv_events.publisher import start_publisher
from dsv4_serving.engine.request import EngineCoreOutput, EngineCoreRequest, Request
from dsv4_serving.engine.worker.step_protocol import (
    Heartbeat,
    ReplicateKV,
    RunStep,
    StopFollowing,
    ToFollower,
)
from dsv4_serving.engine.worker.step_thread import StepThread

if TYPE_CHECKING:
    from concurrent.futures import Future

    from dsv4_serving.engine.kv_connector.worker_side import SidecarConnectorWorker
    from dsv4_serving.engine.worker.model_runner import PreparedStep
    from dsv4_serving.structured.backend import CompiledGrammar
    from dsv4_serving.structured.manager import GrammarManager
    from dsv4_serving.structured.spec import GrammarSpec

log = logging.getLogger(__name__)


class EngineCore:
    """``parallel``/``world``: this rank's groups when the core is TP rank 0 of a parallel
    instance; it then sends each step to its TP followers (``worker.follow``), and with DP
    agrees with the other DP ranks' cores on each step's shape (``_agree``)."""

    def __init__(
        self,
        config: EngineConfig,
        parallel: ModelParallel = SINGLE,
        world: Group = SOLO,
        device_index: int = 0,
    ) -> None:
        from dsv4_serving.engine.kv_connector.worker_side import SidecarConnectorWorker
        from dsv4_serving.engine.worker.runner_setup import setup_runner

        self.config = config
        self.tp = parallel.step  # the followers: TP ranks (x CP ranks)
        self.dp = parallel.dp
        self.dp_control = parallel.dp_control  # the lockstep's group (``_agree``)
        rs = setup_runner(config, parallel, world, device_index, reserve_dummy=self.dp.size > 1)
        lm, k, n_blocks = rs.lm, rs.num_speculative_tokens, rs.num_blocks
        has_state, caching, snaps = rs.has_state, config.enable_prefix_caching, rs.num_snapshots
        self.kv = KVCacheManager(
            n_blocks,
            lm.block_size,
            config.max_num_seqs,
            caching,
            has_state,
            snaps,
            key_next_token=k > 0,
            enable_events=config.kv_events_endpoint is not None,
        )
        self.kv_events = start_publisher(config, self.dp.index, self.kv.snapshot_bounded)
        self.kv_scheduler: SidecarConnectorScheduler | None = None
        if config.kv_sidecar:
            self.kv_scheduler = SidecarConnectorScheduler(config.kv_failure_policy)
        # the async scheduler where it is exact (``config.async_unsupported``), else in turn
        why_not = config.async_unsupported()
        if config.async_scheduling == "on" and why_not:
            raise ValueError(f"--async-scheduling on: {why_not}")
        self.async_scheduling = config.async_scheduling != "off" and why_not is None
        if config.async_scheduling == "auto":
            log.info("async scheduling %s", "on" if why_not is None else f"off: {why_not}")
        self.scheduler = (AsyncScheduler if self.async_scheduling else Scheduler)(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=lm.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                num_speculative_tokens=k,
                prompt_deadline=config.prompt_deadline,
            ),
            self.kv,
            self.kv_scheduler,
        )
        self.runner = rs.runner
        self.steps: StepThread | None = None
        self._in_flight: tuple[SchedulerOutput, Future[dict[str, RunnerResult]], int] | None = None
        if self.async_scheduling:
            self.steps = StepThread(self._run_step)
        kv_dtype = str(lm.dtype).removeprefix("torch.")
        self.kv_worker: SidecarConnectorWorker | None = None
        if config.kv_sidecar and self.kv_scheduler is not None:
            self.kv_worker = SidecarConnectorWorker(
                config.kv_sidecar,
                KVCompat(
                    lm.hf_config["architectures"][0],
                    lm.block_size,
                    k,
                    kv_dtype,
                    config_hash(lm.hf_config) if config.revision is None else config.revision,
                ),
                self.kv_scheduler.stats,
                config.kv_pull_timeout,
            )
            self.kv_worker.register_kv_caches(self.runner.cache)
            peer = self.kv_worker.host_tier_peer()
            self.kv_scheduler.offers_prefixes = peer is not None
            if self.kv_events is not None and peer is not None:
                self.kv_events.host_tier = peer  # the gateway pulls our offers from there
                self.kv_worker.watch_host_evictions()  # and forgets those the tier evicts
        # tracing off: None, and each step tests only that
        self.tracing: CoreTracing | None = None
        tracer = tracing.setup(config.otlp_traces_endpoint, f"dsv4-engine-{config.role}")
        if tracer is not None:
            self.tracing = CoreTracing(tracer, config.role)
            if self.kv_worker is not None:
                self.kv_worker.traceparent_of = self.tracing.traceparent
        self._export_spans: dict[str, contextlib.AbstractContextManager[None]] = {}
        # (schedule, prepare, post-process) seconds of the steps since ``stats`` last ran
        # (bounded: an in-process caller may never ask)
        self._host_spans: deque[tuple[float, float, float]] = deque(maxlen=8192)
        # the last step ran nothing and produced nothing: every request waits for its KV (a
        # pull, or a prefill's export)
        self.idle_waiting_for_kv = False
        # the core's loop sets it: outputs released while a step runs (``_await_step``) go
        # to the front end at once
        self.emit: Callable[[list[EngineCoreOutput]], None] | None = None
        eos = lm.model_config.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        self.eos_ids: list[int] = list(eos) if isinstance(eos, list) else [eos]
        self.eos_ids = [e for e in self.eos_ids if e is not None]
        self.grammars: GrammarManager | None = None  # at the first structured request
        self.migrations = Migrations()  # a drain's requests to move (``drain.py``)
        self.info = EngineInfo(
            max_model_len=lm.max_model_len,
            vocab_size=int(lm.model_config.vocab_size),
            eos_token_id=self.eos_token_id,
            block_size=lm.block_size,
            num_kv_blocks=n_blocks,
            num_speculative_tokens=k,
            architecture=lm.hf_config["architectures"][0],
            kv_dtype=kv_dtype,
            data_parallel_size=self.dp.size,
        )

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue ``req``. The API edge (``entrypoints.checks``) has validated it: the prompt
        fits, the PD params suit this engine's role and a prefill for a remote decode makes one
        token. In-process callers must do the same; this only asserts."""
        n = len(req.prompt_token_ids)
        assert 0 < n < self.info.max_model_len, f"prompt of {n} tokens"
        p = req.kv_transfer_params
        assert p is None or self.kv_worker is not None, "a PD request needs a KV connector"
        if isinstance(p, PrefillRequestParams):
            assert self.config.role != "decode" and req.sampling_params.max_tokens == 1
        elif isinstance(p, RemotePrefillParams):
            assert self.config.role != "prefill"
        spec = req.sampling_params.structured
        grammar = self._compile_grammar(spec) if spec is not None else None
        self.scheduler.add_request(Request(req, self.eos_token_id))
        if grammar is not None:
            assert self.runner.grammars is not None
            k = req.sampling_params.resumed_tokens  # a continued stream's output so far
            self.runner.grammars.add(req.request_id, grammar, req.prompt_token_ids[n - k :])
        if self.tracing is not None:
            self.tracing.add(req)

    def _compile_grammar(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """Compile on the manager's thread (cached by spec), off the loop: a decode's compile
        overlaps its KV pull, a local one the steps before its first sample. The runner holds
        the matcher; its ``finished_ids`` drop it (abort included). A ValueError refuses the
        request before it is queued."""
        from dsv4_serving.engine.worker.model_runner import ModelRunner  # torch: core only

        runner = self.runner
        if not isinstance(runner, ModelRunner):
            raise ValueError("structured outputs need the model runner (not the emulated one)")
        if not self.eos_ids:
            raise ValueError("structured outputs need the model's EOS token id (none configured)")
        if self.grammars is None:
            from dsv4_serving.engine.engine.tokenizer import load_tokenizer
            from dsv4_serving.structured.llguidance_backend import LLGuidanceBackend
            from dsv4_serving.structured.manager import GrammarManager
            from dsv4_serving.structured.request_grammars import RequestGrammars

            vocab = self.info.vocab_size
            backend = LLGuidanceBackend(load_tokenizer(self.config.model).hf, self.eos_ids, vocab)
            self.grammars = GrammarManager(backend)
            runner.grammars = RequestGrammars(vocab, self.eos_ids)
        return self.grammars.compile_async(spec)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        aborted = self.scheduler.abort_requests(request_ids)
        if self.tracing is not None:
            self.tracing.aborted(aborted)
        self._start_kv_loads()  # their pulls let go now, not at the next step
        return aborted

    def migrate(self, request_ids: tuple[str, ...]) -> None:
        """Move these requests to another engine at their next step boundary (``drain.py``)."""
        self.migrations.add(request_ids)

    def kv_housekeeping(self) -> None:
        """An idle engine still finishes what its pulls left (cancelled ones release)."""
        self._start_kv_loads()
        self._finish_kv_loads()
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            if self.kv_worker is not None:
                self.kv.host_tier_moved(self.kv_worker.take_host_evictions())
            events = self.kv.take_events()
            if events:
                self.kv_events.publish(events)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self, admit: bool = True) -> list[EngineCoreOutput]:
        """One forward. With a KV connector, its calls come in this order (vLLM's):

        1. ``_start_kv_loads``: cancels the scheduler side queued (aborted loads) reach the
           worker side before anything else;
        2. ``_finish_kv_loads``: loads that ended since the last step are in their blocks, so
           ``schedule`` runs those requests (or applies the failure policy);
        3. ``schedule``, which may park new decode requests with fresh blocks;
        4. ``_start_kv_loads`` again: those pulls start now, not a step later;
        5. the forward and ``update_from_output``;
        6. ``_save_kv``: prefills finished in 5 start exporting their KV (on the connector's
           thread; their blocks stay allocated and their last outputs held until it ended);
           exports that ended since free their blocks and release those outputs.

        ``admit=False``: no waiting request starts (DP's BalanceScheduler freeze). Under DP
        every rank's core calls ``step`` every turn of the lockstep, busy or not.
        """
        if self.steps is not None:
            return self._step_async(self.steps, admit)
        started = time.perf_counter()
        out = self._schedule(admit)
        scheduled = time.perf_counter()
        t0 = time.time_ns() if self.tracing is not None else 0
        batch, chain = self._agree(out)
        self._tell_followers(RunStep(batch, chain))
        results = self.runner.execute(batch, chain)
        ran = time.perf_counter()
        outputs = self.scheduler.update_from_output(out, results)
        self.scheduler.observe_step(time.perf_counter() - started, out.num_batched_tokens)
        if self.tracing is not None:
            self.tracing.stepped(out, results, t0)
        self._save_kv(outputs)
        self._publish_kv_events()
        if self.tracing is not None:
            self.tracing.finished(outputs)
        self.idle_waiting_for_kv = self.kv_worker is not None and not out.scheduled and not outputs
        if batch.scheduled:
            prepare = self.runner.prepare_s
            self._host_spans.append((scheduled - started, prepare, time.perf_counter() - ran))
        return outputs

    def _schedule(self, admit: bool) -> SchedulerOutput:
        """Steps 1-4 of ``step``."""
        self._start_kv_loads()
        self._finish_kv_loads()
        self.migrations.run(self.scheduler)
        with self.migrations.held_back(self.scheduler):
            out = self.scheduler.schedule(admit)
        if self.tracing is not None:
            self.tracing.scheduled(self.scheduler, out)
        self._start_kv_loads()
        return out

    def _step_async(self, steps: StepThread, admit: bool) -> list[EngineCoreOutput]:
        """Async scheduling: schedule step N+1 and hand it to the step thread (it starts as
        soon as step N ended), then wait for step N and take its outputs, so the step thread
        always has its next step while this thread works. Returns step N's outputs (none on
        the first call of a busy spell). Connector order as in ``step``, around each
        schedule; a KV load lands in its blocks here, between two schedules, never in blocks
        of a step that is running."""
        started = time.perf_counter()
        out = self._schedule(admit)
        scheduled = time.perf_counter()
        batch, chain = self._agree(out)  # DP: the ranks agree on N+1 here, on this thread
        nxt = None
        if batch.scheduled or batch.finished_ids or batch.state_copies:
            t0 = time.time_ns() if self.tracing is not None else 0
            # N+1's inputs too, while N runs (``ModelRunner.prepare_ahead``)
            prepared = self.runner.prepare_ahead(batch)
            nxt = (out, steps.submit(batch, chain, prepared), t0)
        prev, self._in_flight = self._in_flight, nxt
        if prev is None:
            outputs = self.scheduler.take_extra_outputs()
        else:
            done, future, t0 = prev
            results = self._await_step(future)
            ran = time.perf_counter()
            outputs = self.scheduler.update_from_output(done, results)
            self.scheduler.observe_step(time.perf_counter() - started, done.num_batched_tokens)
            if self.tracing is not None:
                self.tracing.stepped(done, results, t0)
        self._save_kv(outputs)
        self._publish_kv_events()  # N+1's schedule and N's outputs, as ``step`` does
        if self.tracing is not None:
            self.tracing.finished(outputs)
        if prev is None and nxt is None and self.dp.size > 1:
            self.heartbeat()  # DP turns step an idle core: its TP followers hear of it
        idle = prev is None and nxt is None and not outputs
        self.idle_waiting_for_kv = self.kv_worker is not None and idle
        if prev is not None and prev[0].scheduled:  # N+1's schedule, N's prepare and outputs
            spans = (scheduled - started, self.runner.prepare_s, time.perf_counter() - ran)
            self._host_spans.append(spans)
        return outputs

    def _run_step(
        self,
        out: SchedulerOutput,
        chain: bool | None,
        prepared: PreparedStep | None,
        started: Callable[[], None],
    ) -> dict[str, RunnerResult]:
        """One step on the step thread; the TP followers get it from there too (its
        placeholders filled), so every broadcast to them keeps the steps' order."""
        self._tell_followers(RunStep(out, chain))
        return self.runner.execute(out, chain, prepared, started)

    def _agree(self, out: SchedulerOutput) -> tuple[SchedulerOutput, bool | None]:
        """What this rank runs and whether it chains MTP calls: under DP every rank runs a
        forward when any rank has tokens (an idle one a dummy batch) and the MTP chain when
        any rank drafts, so every EP rank makes the same MoE calls in the same order."""
        if self.dp.size == 1:
            return out, None
        from dsv4_serving.distributed.comm import all_gather_object  # torch: core only

        shares = all_gather_object(
            (out.num_batched_tokens, any(s.sample for s in out.scheduled)), self.dp_control
        )
        chain = any(drafts for _, drafts in shares)
        if out.scheduled or not any(n for n, _ in shares):
            return out, chain
        dummy = self.runner.dummy_step()
        return replace(dummy, state_copies=out.state_copies, finished_ids=out.finished_ids), chain

    def _tell_followers(self, msg: ToFollower) -> None:
        if self.tp.size > 1:
            from dsv4_serving.distributed.comm import broadcast_object  # torch: core only

            broadcast_object(msg, self.tp)

    def heartbeat(self) -> None:
        """Idle: the TP followers wait in a collective that must not reach its timeout."""
        self._tell_followers(Heartbeat())

    def _start_kv_loads(self) -> None:
        """Hand the worker side the loads (and cancels) the scheduler side queued."""
        if self.kv_worker is not None:
            assert self.kv_scheduler is not None
            self.kv_worker.start_load_kv(self.kv_scheduler.build_connector_meta())

    def _finish_kv_loads(self) -> None:
        """Loads that ended: imported into their blocks (or failed), told to the scheduler.
        The TP followers' replicated caches get the same blocks first."""
        if self.kv_worker is not None:
            done = self.kv_worker.get_finished()
            if self.tracing is not None:
                self.tracing.loaded(done)
            if done.loaded_kv and self.tp.size > 1:
                from dsv4_serving.engine.kv_connector.tp_replicate import replicate_kv

                loads = done.loaded_kv

                def replicate() -> None:
                    self._tell_followers(ReplicateKV(loads))
                    replicate_kv(self.runner.cache, loads, self.tp)

                if self.steps is None:
                    replicate()
                else:  # between two steps of the step thread: the followers' order
                    self.steps.call(replicate)
            self.scheduler.update_from_connector(done)

    def _save_kv(self, outputs: list[EngineCoreOutput]) -> None:
        """Start exporting the KV of prefills (for a remote decode) that finished this step,
        holding back their last outputs; add those of exports that ended since the last step,
        now with their ``kv_transfer_params``. The export runs beside the next steps."""
        if self.kv_worker is None:
            return
        assert self.kv_scheduler is not None
        saves = self.kv_scheduler.take_saves()
        if saves:
            self.scheduler.hold_saving_outputs(outputs)
            traceparents: dict[str, str | None] = {}
            if self.tracing is not None:
                for s in saves:  # a span per export, open until its result is taken
                    opened = self.tracing.export([s])
                    opened.__enter__()
                    self._export_spans[s.request_id] = opened
                    traceparents[s.request_id] = self.tracing.traceparent(s.request_id)
            self.kv_worker.start_save_kv(saves, traceparents)
        self._take_finished_saves(outputs)

    def _take_finished_saves(self, outputs: list[EngineCoreOutput]) -> None:
        """Exports that ended: their blocks freed, their held last outputs added to
        ``outputs``."""
        assert self.kv_worker is not None
        done = self.kv_worker.get_finished_saves()
        if done:
            for rid in done:
                ended = self._export_spans.pop(rid, None)
                if ended is not None:
                    ended.__exit__(None, None, None)
            self.scheduler.saves_done(done, outputs)

    def _await_step(self, future: Future[dict[str, RunnerResult]]) -> dict[str, RunnerResult]:
        """Step N's results (async scheduling). While N runs, an export that ends releases
        its request's last output at once through ``emit``: a PD prefill's answer waits for
        its KV, not also for the step beside it (a long prefill chunk, 100-200 ms on 2 CPU
        cores). Its blocks are free for N+2's schedule: N+1 was scheduled without them."""
        worker = self.kv_worker
        if worker is None or self.emit is None:
            return future.result()
        future.add_done_callback(lambda _f: worker.wake())
        while not future.done():
            worker.wait_for_event(1.0)
            released: list[EngineCoreOutput] = []
            self._take_finished_saves(released)
            if released:
                if self.tracing is not None:
                    self.tracing.finished(released)
                self.emit(released)
        return future.result()

    def wait_for_kv(self, timeout_s: float) -> None:
        """Nothing ran last step (every request waits for its KV): sleep until a pull or an
        export ends."""
        if self.kv_worker is not None:
            self.kv_worker.wait_for_event(timeout_s)

    def close(self, stop_followers: bool = True) -> None:
        if self.steps is not None:
            self.steps.close()
        if stop_followers:
            self._tell_followers(StopFollowing())
        if self.kv_worker is not None:
            self.kv_worker.close()
        if self.grammars is not None:
            self.grammars.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def stats(self) -> SchedulerStats:
        out = self.scheduler.snapshot_stats()
        out.host_spans = list(self._host_spans)
        self._host_spans.clear()
        eplb = getattr(self.runner, "eplb", None)  # None unless --enable-eplb
        if eplb is not None:
            out.eplb = eplb.stats
        return out
