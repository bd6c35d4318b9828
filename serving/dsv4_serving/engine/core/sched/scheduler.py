"""Continuous batching: which requests run this step and with how many tokens. Pure Python.

Every request is one number, ``num_computed_tokens``, chasing ``num_tokens`` (+ its draft
tokens): a prefill chunk, a decode token and a verification run are the same thing, so
prefill chunks and decode tokens share one step under one token budget. Running requests go
first (FCFS among them); when blocks run out the most recently arrived running request is
preempted (its blocks freed, recomputed later from its tokens). Waiting requests are admitted
in arrival order while budget, sequence slots and blocks last. With a prompt deadline
(``SchedulerConfig.prompt_deadline``) the prompts, running and waiting, are ordered instead:
those that can still make their deadline first, the late ones only in steps no on-time prompt
is in (``prefill_order.py``, ``_schedule_prompts``).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dsv4_kvtransfer.pd_protocol import (
    PrefillRequestParams,
    RemotePrefillParams,
    prefix_pull_of,
    without_prefix_pull,
)
from dsv4_serving.engine.core.kv_cache_manager import KVCacheManager
from dsv4_serving.engine.core.sched.output import (
    RunnerResult,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from dsv4_serving.engine.core.sched.prefill_order import Prompt, StepCostModel, prefill_order
from dsv4_serving.engine.core.sched.prefix_pull import (
    offer_finished,
    park_for_prefix,
    prefix_loaded,
)
from dsv4_serving.engine.core.sched.stops import append_tokens
from dsv4_serving.engine.kv_connector.base import KVConnectorScheduler
from dsv4_serving.engine.kv_connector.metadata import (
    KVConnectorOutput,
    KVTransferFailure,
)
from dsv4_serving.engine.request import EngineCoreOutput, Request, RequestStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    num_speculative_tokens: int = 0
    prompt_deadline: float = 0.0
    """Seconds after its arrival a prompt's first token is due; > 0 orders the waiting prompts
    by it (``prefill_order.py``), 0 keeps them first come, first served."""


class RemoteKV(enum.Enum):
    """What admitting the first waiting request did about remote KV."""

    LOCAL = "local"  # its prompt is computed here: admit it as usual
    PARKED = "parked"  # blocks and slot allocated, its KV is on the way
    NO_BLOCKS = "no_blocks"  # it needs remote KV but its blocks cannot be had yet


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        connector: KVConnectorScheduler | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.kv = kv
        self.connector = connector
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # blocks + slot allocated, KV on its way from a prefill engine: never scheduled
        self.waiting_for_remote_kv: dict[str, Request] = {}
        # finished, blocks and slot kept (and the last output held) until their KV is saved
        self._saving: dict[str, Request] = {}
        self._held: dict[str, EngineCoreOutput] = {}
        self._finished_ids: list[str] = []
        self._extra_outputs: list[EngineCoreOutput] = []  # produced outside a forward
        self.stats = SchedulerStats(num_total_blocks=kv.pool.num_blocks)
        # the prompt deadline's order: the engine's own speed, the clock arrivals are read on
        # (the front end stamps them with time.time), the prompts set behind so far
        self.step_cost: StepCostModel | None = None
        if config.prompt_deadline > 0:
            self.step_cost = StepCostModel()
        self.clock = clock
        self._late: set[str] = set()

    # ---- requests in and out ---------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                del self.waiting_for_remote_kv[rid]
            else:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            aborted.append(rid)
        return aborted

    def migrate(self, req: Request) -> None:
        """End running ``req`` here for another engine to continue it (a drain): its KV is
        exported as a finished prefill's is (the connector), and its last output, with no
        token and ``finish_reason`` "migrate", goes out with the export's params."""
        self.running.remove(req)
        self._finish(req, RequestStatus.FINISHED_MIGRATED)
        self._extra_outputs.append(EngineCoreOutput(req.request_id, [], finish_reason="migrate"))

    def has_unfinished_requests(self) -> bool:
        """Requests running or waiting, or finished prefills whose KV export is under way (the
        engine keeps stepping until their responses are out)."""
        return bool(self.requests) or bool(self._saving)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        rid = req.request_id
        c = self.connector
        if c is not None and c.request_finished(
            req, status, self.kv.block_ids(rid), self.kv.req_slot.get(rid)
        ):
            self._saving[rid] = req  # freed by saves_done, once the export ended
        elif (
            c is not None
            and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
            and offer_finished(self.kv, c, req)
        ):
            self._saving[rid] = req  # its offer to the host tier: freed the same way
        else:
            self.kv.free(req)
        del self.requests[rid]
        self._late.discard(rid)
        self._finished_ids.append(rid)

    # ---- the KV connector (PD) ----------------------------------------------------------------

    def update_from_connector(self, out: KVConnectorOutput) -> None:
        """Loads the worker side finished: the KV is in the request's blocks and slot."""
        if self.connector is None:
            return
        self.connector.update_connector_output(out)
        for rid in out.loaded:
            req = self.waiting_for_remote_kv.pop(rid, None)
            if req is None:
                continue
            if prefix_pull_of(req.kv_transfer_params) is not None:
                prefix_loaded(req)  # the rest of its prompt is computed here
                # counted once its prefix is in (a failed pull is counted when admitted
                # again): the local hit and the pulled tokens both count as hits
                self.stats.prefix_queries += req.num_tokens
                self.stats.prefix_hits += req.num_computed_tokens
            else:
                # every prompt token's KV is there; the last one is computed again (logits)
                req.num_computed_tokens = req.num_prompt_tokens - 1
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = 0
                req.kv_transfer_params = None  # a local request from now on (e.g. preempted)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.kv.cache_blocks(req)
        for rid, failure in out.failed.items():
            req = self.waiting_for_remote_kv.pop(rid, None)
            if req is not None:
                self._load_failed(req, failure)

    def _load_failed(self, req: Request, failure: KVTransferFailure) -> None:
        assert self.connector is not None
        if self.connector.on_load_failed(req, failure):
            # prefill it here instead: nothing was written to its blocks, start from scratch
            req.kv_transfer_params = without_prefix_pull(req.kv_transfer_params)
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
            return
        self._finish(req, RequestStatus.FINISHED_ERROR)
        self._extra_outputs.append(
            EngineCoreOutput(req.request_id, [], finish_reason="error", error=failure)
        )

    def hold_saving_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Take the last outputs of prefills (and of sequences a drain moved) whose KV export
        just started out of ``outputs``: each goes out with its ``kv_transfer_params`` (or the
        error) once the export ended."""
        keep = []
        for o in outputs:
            saving = self._saving.get(o.request_id)
            # an offer to the host tier holds nothing back: only a PD export's params do, and a
            # moved sequence's (a decode's: its own params, if any, are its pull's), else its
            # migrate block went out with no params and nobody pulled the export
            pd = saving is not None and (
                isinstance(saving.kv_transfer_params, PrefillRequestParams)
                or saving.status == RequestStatus.FINISHED_MIGRATED
            )
            if pd and o.finish_reason is not None:
                self._held[o.request_id] = o
            else:
                keep.append(o)
        outputs[:] = keep

    def saves_done(
        self,
        results: dict[str, RemotePrefillParams | KVTransferFailure],
        outputs: list[EngineCoreOutput],
    ) -> None:
        """The worker side saved (or failed to save) the KV of finished prefills: free their
        blocks and add their held last outputs, with the ``kv_transfer_params`` (or the error),
        to ``outputs``."""
        for rid, res in results.items():
            req = self._saving.pop(rid, None)
            if req is not None:
                if not isinstance(res, KVTransferFailure):
                    self.kv.offer_stored(req)  # an offer's event (nothing for a PD export)
                self.kv.free(req)
            o = self._held.pop(rid, None)
            if o is None:
                continue
            if isinstance(res, KVTransferFailure):
                o.error = res
            else:
                o.kv_transfer_params = res
            outputs.append(o)

    def take_extra_outputs(self) -> list[EngineCoreOutput]:
        out, self._extra_outputs = self._extra_outputs, []
        return out

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self, admit: bool = True) -> SchedulerOutput:
        """``admit=False``: only running requests go on (DP's BalanceScheduler freeze)."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        k = cfg.num_speculative_tokens
        plan: list[tuple[Request, int]] = []
        preempted = False
        # a prompt deadline, once the engine's speed is known: running prompts are ordered
        # with the waiting ones (``_schedule_prompts``), not served first
        ordered = self.step_cost is not None and self.step_cost.cost is not None
        deferred: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if ordered and self._is_prompt(req):
                deferred.append(req)
                i += 1
                continue
            ctx = req.num_computed_tokens
            end = req.num_tokens + req.num_output_placeholders  # placeholders: async only
            want = end + len(req.spec_token_ids) - ctx
            num_new = min(want, budget, cfg.max_model_len - ctx)
            if num_new <= 0 or self._waits_for_output(req):
                i += 1
                continue
            sample = ctx + num_new >= end
            preemptions = self.stats.num_preemptions
            placed = self._allocate_or_preempt(req, num_new, k if sample else 0, plan)
            preempted = preempted or self.stats.num_preemptions != preemptions
            if placed:
                plan.append((req, num_new))
                budget -= num_new
                i += 1

        if ordered:
            budget = self._schedule_prompts(deferred, admit and not preempted, budget, plan)
        while (
            not ordered
            and admit
            and not preempted
            and self.waiting
            and budget > 0
            and len(self.running) + len(self.waiting_for_remote_kv) < cfg.max_num_seqs
        ):
            used = self._admit(self.waiting[0], budget, plan)
            if used is None:
                break  # FCFS: it stays first in line
            self.waiting.popleft()
            budget -= used

        scheduled = [self._describe(req, n) for req, n in plan]
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            state_copies=self.kv.take_state_copies(),
            finished_ids=finished,
            num_batched_tokens=cfg.max_num_batched_tokens - budget,
        )

    def _admit(self, req: Request, budget: int, plan: list[tuple[Request, int]]) -> int | None:
        """Start waiting ``req`` with at most ``budget`` tokens (the caller takes it out of
        ``waiting``): the budget it used (0: parked until its remote KV is in), or None when
        it cannot start now."""
        if self.connector is not None:
            remote = self._park_for_remote_kv(req)
            if remote is RemoteKV.PARKED:
                return 0
            if remote is RemoteKV.NO_BLOCKS:
                return None
        computed = self.kv.get_computed_blocks(req)
        num_new = req.num_tokens - computed.num_tokens
        if not self.config.enable_chunked_prefill and num_new > budget:
            return None
        num_new = min(num_new, budget)
        sample = computed.num_tokens + num_new >= req.num_tokens
        lookahead = self.config.num_speculative_tokens if sample else 0
        if not self.kv.allocate_slots(req, num_new, computed, lookahead):
            return None
        self.stats.prefix_queries += req.num_tokens
        self.stats.prefix_hits += computed.num_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = computed.num_tokens
        req.num_computed_tokens = computed.num_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        plan.append((req, num_new))
        return num_new

    def _waits_for_output(self, req: Request) -> bool:
        """Running ``req`` sits this step out until a step in flight returns (async only)."""
        return False

    @staticmethod
    def _is_prompt(req: Request) -> bool:
        """Its first token is still to come from a prompt computed here."""
        return (
            not req.num_output_tokens
            and not req.num_output_placeholders
            and not isinstance(req.kv_transfer_params, RemotePrefillParams)
        )

    def _schedule_prompts(
        self, deferred: list[Request], admit: bool, budget: int, plan: list[tuple[Request, int]]
    ) -> int:
        """The prompt deadline's half of a step, after the running requests past their first
        token: waiting requests past theirs (preempted) and those whose KV comes from a prefill
        engine first, as FCFS has them; then the prompts, running (``deferred``) or waiting,
        that can still make their deadline (``prefill_order``). The late ones, in arrival order,
        only get a step no on-time prompt is in: sharing one would make it longer for the
        on-time prompt and for the ones arriving behind it. A running prompt keeps its blocks
        while it waits its turn. Returns the budget left."""
        assert self.step_cost is not None
        cost = self.step_cost.cost
        assert cost is not None
        cfg = self.config
        front = [r for r in self.waiting if not self._is_prompt(r)] if admit else []
        prompts = deferred + ([r for r in self.waiting if self._is_prompt(r)] if admit else [])
        prompts.sort(key=lambda r: r.arrival_time)  # stable: the queue's order among equals
        order, on_time = prefill_order(
            [
                Prompt(r.arrival_time + cfg.prompt_deadline, r.num_tokens - r.num_computed_tokens)
                for r in prompts
            ],
            self.clock(),
            cost,
            cfg.max_num_batched_tokens - budget,  # this step's tokens so far
            cfg.max_num_batched_tokens,
        )
        for i in order[on_time:]:
            if prompts[i].request_id not in self._late:
                self._late.add(prompts[i].request_id)
                self.stats.num_late_prompts += 1
        queue = front + [prompts[i] for i in order]
        if admit:
            self.waiting = deque(r for r in queue if r.status is not RequestStatus.RUNNING)
        admitting = admit
        on_time_served = False
        for n, req in enumerate(queue):
            if budget <= 0 or (n >= len(front) + on_time and on_time_served):
                break
            before = budget
            if req.status is RequestStatus.RUNNING:
                preemptions = self.stats.num_preemptions
                budget -= self._continue_prompt(req, budget, plan)
                if self.stats.num_preemptions != preemptions:
                    admitting = False  # blocks ran out: nothing starts this step
            elif admitting and req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                if len(self.running) + len(self.waiting_for_remote_kv) >= cfg.max_num_seqs:
                    admitting = False
                    continue
                used = self._admit(req, budget, plan)
                if used is None:
                    admitting = False  # head of the line, as FCFS: nothing after it starts
                    continue
                budget -= used
            if len(front) <= n < len(front) + on_time and budget < before:
                on_time_served = True
        if admit:
            self.waiting = deque(
                r
                for r in self.waiting
                if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            )
        return budget

    def _continue_prompt(self, req: Request, budget: int, plan: list[tuple[Request, int]]) -> int:
        """The next chunk of running prompt ``req``: the budget it used (``_allocate_or_preempt``
        as for every running request)."""
        cfg = self.config
        ctx = req.num_computed_tokens
        num_new = min(req.num_tokens - ctx, budget, cfg.max_model_len - ctx)
        if num_new <= 0:
            return 0
        sample = ctx + num_new >= req.num_tokens
        lookahead = cfg.num_speculative_tokens if sample else 0
        if not self._allocate_or_preempt(req, num_new, lookahead, plan):
            return 0
        plan.append((req, num_new))
        return num_new

    def _allocate_or_preempt(
        self, req: Request, num_new: int, lookahead: int, plan: list[tuple[Request, int]]
    ) -> bool:
        """Blocks for ``num_new`` more tokens of running ``req``; while they run out, the newest
        running request not in this step's ``plan`` is preempted. False: ``req`` itself was."""
        while not self.kv.allocate_slots(req, num_new, num_lookahead_tokens=lookahead):
            planned = {id(r) for r, _ in plan}
            victim = next(r for r in reversed(self.running) if id(r) not in planned)
            self.running.remove(victim)
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def observe_step(self, seconds: float, num_batched_tokens: int) -> None:
        """A step of ``num_batched_tokens`` took ``seconds`` (wall clock, scheduling included):
        the prompt deadline's estimate of how fast prompts are computed."""
        if self.step_cost is not None:
            self.step_cost.observe(seconds, num_batched_tokens)

    def _park_for_remote_kv(self, req: Request) -> RemoteKV:
        """A request whose prompt KV comes from a prefill engine gets blocks for its whole
        prompt (+ lookahead) and a slot, then waits parked until the KV is in them."""
        assert self.connector is not None
        if self.connector.get_num_new_matched_tokens(req) is None:
            return RemoteKV.LOCAL
        if prefix_pull_of(req.kv_transfer_params) is not None:
            k = self.config.num_speculative_tokens
            parked = park_for_prefix(self.kv, self.connector, req, k)
            if parked is None:
                return RemoteKV.NO_BLOCKS
            if not parked:
                return RemoteKV.LOCAL
            self.waiting_for_remote_kv[req.request_id] = req
            return RemoteKV.PARKED
        if not self.kv.allocate_slots(
            req, req.num_tokens, None, self.config.num_speculative_tokens
        ):
            return RemoteKV.NO_BLOCKS
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting_for_remote_kv[req.request_id] = req
        rid = req.request_id
        self.connector.update_state_after_alloc(req, self.kv.block_ids(rid), self.kv.req_slot[rid])
        return RemoteKV.PARKED

    def _describe(self, req: Request, num_new: int) -> ScheduledRequest:
        # once per running request per step: each property read and call counts at 256
        ctx = req.num_computed_tokens
        end = ctx + num_new
        n = req.num_tokens
        known = min(end, n)
        num_spec = end - known
        if num_spec != len(req.spec_token_ids):
            req.spec_token_ids = req.spec_token_ids[:num_spec]
        sample = known >= n
        rid = req.request_id
        return ScheduledRequest(
            request_id=rid,
            token_ids=req.all_token_ids[ctx:known] + req.spec_token_ids,
            context_len=ctx,
            num_spec=num_spec,
            block_ids=self.kv.block_ids(rid),
            state_slot=self.kv.req_slot[rid],
            sample=sample,
            next_token=req.all_token_ids[end] if end < n else None,
            sampling_params=req.sampling_params,
            num_output_tokens=n - req.num_prompt_tokens,
            # a chunk of one token has no block boundary strictly inside it
            snapshots=self.kv.plan_snapshots(req, ctx, end) if not num_spec and num_new > 1 else [],
            prompt_token_ids=self._history_start(req, n) if sample else None,
        )

    @staticmethod
    def _history_start(req: Request, num_tokens: int) -> list[int] | None:
        """The prompt, at a sampling step's first sample of a request with penalties."""
        first_sample = num_tokens == req.num_prompt_tokens
        if first_sample and req.sampling_params.uses_history:
            return req.all_token_ids[: req.num_prompt_tokens]
        return None

    def update_from_output(
        self, out: SchedulerOutput, results: dict[str, RunnerResult]
    ) -> list[EngineCoreOutput]:
        outputs = []
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None:
                continue
            if not s.sample:
                req.num_computed_tokens += len(s.token_ids)
                self.kv.cache_blocks(req)
                continue
            r = results[s.request_id]
            accepted = len(r.token_ids) - 1
            if s.num_spec:
                self.stats.spec_drafts += 1
                self.stats.spec_draft_tokens += s.num_spec
                self.stats.spec_accepted_tokens += accepted
            req.num_computed_tokens += len(s.token_ids) - (s.num_spec - accepted)
            req.spec_token_ids = []
            new, status = append_tokens(req, r.token_ids, self.config.max_model_len)
            logprobs = r.logprobs[: len(new)] if r.logprobs is not None else None
            self.kv.cache_blocks(req)
            out_ = EngineCoreOutput(
                req.request_id, new, logprobs, num_cached_tokens=max(req.num_cached_tokens, 0)
            )
            if status is None:
                req.spec_token_ids = list(r.draft_ids)
            else:
                self.running.remove(req)
                self._finish(req, status)
                out_.finish_reason = status.value
                out_.stop_token_id = req.stop_token_id
            outputs.append(out_)
        outputs.extend(self.take_extra_outputs())
        self._refresh_stats()
        return outputs

    def _refresh_stats(self) -> None:
        st = self.stats
        # a finished prefill whose KV export is under way still has its client waiting (its
        # response goes out with the export's params): running, so a drain waits for it
        st.num_running = len(self.running) + len(self._saving)
        st.num_waiting = len(self.waiting) + len(self.waiting_for_remote_kv)
        st.kv_usage = self.kv.usage()
        st.num_free_blocks = self.kv.num_free_blocks

    def load(self) -> tuple[int, int]:
        """(running, waiting) as the stats count them."""
        self._refresh_stats()
        return self.stats.num_running, self.stats.num_waiting

    def snapshot_stats(self) -> SchedulerStats:
        self._refresh_stats()
        out = SchedulerStats(**{f: getattr(self.stats, f) for f in SchedulerStats.__slots__})
        if self.connector is not None:
            out.kv_transfer = self.connector.stats.take()
        return out
