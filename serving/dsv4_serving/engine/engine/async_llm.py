"""The front end's handle on the engine core process: requests in, text increments out.

The core runs in a child process (spawned, so it owns its torch state and threads); two
multiprocessing queues connect them. A parallel instance spawns one process per rank
(``engine.worker``); rank 0 is the core the queues reach, and any rank that exits ends the
instance: every request fails with the reason and the other ranks are killed. A reader thread hands core messages to the event loop.
Detokenization and stop strings happen here, as in vLLM's output processor: when a stop string
appears the request is finished here and aborted in the core. Each request's increments go to
its handler through a coalescing mailbox (``increments.py``); this processing's time per step
message is the host's **stream** time (``host_times.py``, with the core's spans of each step).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, assert_never

from dsv4_common.process import free_port_below_ephemeral
from dsv4_kvtransfer.pd_protocol import PrefillRequestParams, PrefixPullParams, RemotePrefillParams
from dsv4_serving.distributed.launcher import LocalRanks
from dsv4_serving.distributed.placement import Placement
from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.core.sched.scheduler import SchedulerStats
from dsv4_serving.engine.engine.core_process import run_engine_core
from dsv4_serving.engine.engine.host_times import HostTimes, StepSpans
from dsv4_serving.engine.engine.increments import Mailbox, RequestOutput
from dsv4_serving.engine.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    EngineInfo,
    FromCore,
    MigrateRequests,
    Outputs,
    Ready,
    Rejected,
    Shutdown,
    ToCore,
)
from dsv4_serving.engine.engine.observer import EngineObserver, NullObserver
from dsv4_serving.engine.engine.stop_strings import StopStrings
from dsv4_serving.engine.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from dsv4_serving.engine.request import EngineCoreOutput, EngineCoreRequest, Logprob
from dsv4_serving.engine.sample.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class KVTransferError(RuntimeError):
    """A PD request's KV could not be exported (prefill) or pulled (decode, policy fail)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class _State:
    prompt_len: int
    detok: IncrementalDetokenizer
    stops: StopStrings
    box: Mailbox = field(default_factory=Mailbox)
    arrival: float = field(default_factory=time.monotonic)
    last_token: float | None = None
    finished: bool = False
    # ``generate``'s ``collect``: the tokens (and logprobs) since the first increment, held
    # undecoded until the last
    collect: bool = False
    held_ids: list[int] = field(default_factory=list)
    held_logprobs: list[Logprob] | None = None


class AsyncLLM:
    def __init__(
        self, config: EngineConfig, tokenizer: Tokenizer, observer: EngineObserver | None = None
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.observer: EngineObserver = observer or NullObserver()
        self.info: EngineInfo | None = None
        self.stats = SchedulerStats()  # the instance's
        self.rank_stats: tuple[SchedulerStats, ...] = ()  # each DP rank's
        self._states: dict[str, _State] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ranks: LocalRanks | None = None
        self._reader: threading.Thread | None = None
        self._closing = False
        self.dead_reason: str | None = None
        # called (in the event loop) once the core is dead: the server stops and exits non-zero
        self.on_dead: Callable[[str], None] | None = None
        self._ids = itertools.count()
        self.host_times = HostTimes()  # per step: the core's spans and this stream time
        # a step's inter-token gaps: (seconds, tokens) -> requests (most share the last step's)
        self._gaps: collections.Counter[tuple[float, int]] = collections.Counter()
        # streams a gateway can continue elsewhere: a drain moves them (``engine/drain.py``)
        self.movable: set[str] = set()

    # ---- lifecycle --------------------------------------------------------------------

    def start(self, timeout_s: float = 600.0, placement: Placement | None = None) -> EngineInfo:
        """Spawn the core (and its peer ranks on this node: node 0 of ``placement``) and wait
        until the model is loaded (blocking); the other nodes run ``dsv4 engine --headless``."""
        self.launch(placement)
        return self.wait_ready(timeout_s)

    def launch(self, placement: Placement | None = None) -> None:
        """Spawn the core and its peer ranks and return at once: the caller's own start-up
        (the HTTP front end's imports) then overlaps the core's torch import and model load."""
        ctx = mp.get_context("spawn")
        self._in: Any = ctx.Queue()
        self._out: Any = ctx.Queue()
        placement = placement or Placement()
        topo = self.config.topology(placement.nnodes)
        args: list[tuple[Any, ...]]
        if topo.world == 1:
            args = [(self.config, self._in, self._out)]
            self._ranks = LocalRanks(run_engine_core, args, "dsv4-engine-core")
        else:
            from dsv4_serving.engine.worker.worker import rank_main  # torch: imported by the ranks

            if not placement.master_port:
                # not free_port(): a port the caller picked for another process (and has not
                # bound yet) could come back from the same ephemeral range
                placement = replace(placement, master_port=free_port_below_ephemeral())
            ranks = placement.ranks(topo)
            args = [(self.config, r, placement, self._in, self._out) for r in ranks]
            self._ranks = LocalRanks(rank_main, args, "dsv4-rank")

    def wait_ready(self, timeout_s: float = 600.0) -> EngineInfo:
        """Block until the launched core has loaded its model (or died, or ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self._out.get(timeout=0.5)
                break
            except queue.Empty:
                dead = self._death()
                if dead is not None:
                    self.shutdown()
                    raise EngineDeadError(f"{dead} while starting") from None
                if time.monotonic() > deadline:
                    self.shutdown()
                    raise EngineDeadError(f"engine core not ready after {timeout_s}s") from None
        if not isinstance(msg, Ready):
            self.shutdown()
            raise EngineDeadError(f"engine core failed to start: {msg.message}")
        self.info = msg.info
        return msg.info

    def _death(self) -> str | None:
        """Why the instance is dead (a rank exited), or None."""
        assert self._ranks is not None
        dead = self._ranks.first_dead()
        if dead is None:
            return None
        rank, code = dead
        if len(self._ranks.procs) == 1:
            return f"engine core exited with code {code}"
        return f"rank {rank} of {len(self._ranks.procs)} exited with code {code}"

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start delivering core messages to ``loop`` (call from inside it, once the server is
        built)."""
        self._loop = loop
        # the server's startup heap is never garbage: out of the collector's sight, so a full
        # collection scans only the requests' objects (one over it all took ~40 ms at 256
        # sequences, admissions and answers waiting); as the core does
        gc.collect()
        gc.freeze()
        self._reader = threading.Thread(target=self._read, name="dsv4-core-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._ranks is not None and self._ranks.alive and self.dead_reason is None

    def shutdown(self) -> None:
        self._closing = True
        if self._ranks is None:
            return
        if self._ranks.alive:
            with contextlib.suppress(OSError, ValueError):
                self._send(Shutdown())
        self._ranks.join(timeout_s=10)
        if self._reader is not None:
            self._reader.join(timeout=2)

    def _read(self) -> None:
        assert self._loop is not None
        assert self._ranks is not None
        while not self._closing:
            dead = self._death()
            if dead is not None and not self._closing:
                reason = f"engine core died: {dead}"
                self._post(self._fail_all, reason)
                self._ranks.kill()  # the rest of a broken instance
                return
            try:
                msg = self._out.get(timeout=0.5)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return
            self._post(self._dispatch, msg)

    def _post(self, fn: Callable[[Any], None], arg: Any) -> None:
        """Hand ``fn(arg)`` to the event loop; dropped quietly once the loop is closed (a
        message between the end of ``asyncio.run`` and ``shutdown``: nobody awaits it)."""
        assert self._loop is not None
        if self._loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # closed between the check and the call
            self._loop.call_soon_threadsafe(fn, arg)

    def _send(self, msg: ToCore) -> None:
        self._in.put(msg)

    # ---- requests ---------------------------------------------------------------------

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}-{next(self._ids)}"

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        kv_transfer_params: PrefillRequestParams
        | RemotePrefillParams
        | PrefixPullParams
        | None = None,
        data_parallel_rank: int | None = None,
        traceparent: str | None = None,
        continued: Sequence[int] = (),
        sent_chars: int = 0,
        movable: bool = False,
        collect: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Increments until the request finishes; closing the iterator early aborts it.
        ``data_parallel_rank``: the DP rank to run on (None: the least loaded). ``continued``:
        output another engine generated, whose text's first ``sent_chars`` characters the
        client has (``entrypoints/continuation.py``): the core computes it with the prompt,
        and it counts as output here. ``movable``: a drain (``migrate``) may end it with
        ``finish_reason`` "migrate" for another engine to continue. ``collect``: the consumer
        reads the answer whole (not streamed): after the first increment (it tells ``n`` > 1
        that the prompt is cached) the next come as one, the last, so neither the
        detokenizer nor the consumer runs per step; not with stop strings (they need each
        step's text)."""
        if not self.alive:
            raise EngineDeadError(self.dead_reason or "engine core is not running")
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        stops = StopStrings(params.stop)
        if continued:
            detok.add(list(continued), final=False)
            stops.sent = sent_chars
        st = _State(len(prompt_token_ids), detok, stops, collect=collect and not params.stop)
        self._states[request_id] = st
        req = EngineCoreRequest(
            request_id,
            [*prompt_token_ids, *continued],
            params,
            kv_transfer_params=kv_transfer_params,
            data_parallel_rank=data_parallel_rank,
            traceparent=traceparent,
        )
        self._send(AddRequest(req))
        if movable:
            self.movable.add(request_id)
        try:
            while True:
                item = await st.box.take()  # raises the request's error
                yield item
                if item.finished:
                    return
        finally:
            self.movable.discard(request_id)
            if not st.finished:
                self.abort(request_id)

    def migrate(self) -> int:
        """Move every movable request to another engine (a drain): each ends at its next
        step boundary with ``finish_reason`` "migrate" (and, with a KV connector, its KV's
        ``kv_transfer_params``). -> how many were asked to move."""
        ids = tuple(sorted(r for r in self.movable if r in self._states))
        if ids and self.alive:
            self._send(MigrateRequests(ids))
        return len(ids)

    def abort(self, request_id: str) -> None:
        st = self._states.pop(request_id, None)
        if st is not None:
            st.finished = True
            self.observer.aborted()
        if self.alive:
            self._send(AbortRequests([request_id]))

    # ---- messages from the core (event loop thread) -----------------------------------

    def _fail_all(self, reason: str) -> None:
        first = self.dead_reason is None
        self.dead_reason = reason
        for st in self._states.values():
            st.finished = True
            st.box.put(EngineDeadError(reason))
        self._states.clear()
        if first and self.on_dead is not None:
            self.on_dead(reason)

    def _dispatch(self, msg: FromCore) -> None:
        match msg:
            case Outputs(outputs=outputs, stats=stats, rank_stats=ranks):
                started = time.perf_counter()
                now = time.monotonic()  # the step's outputs arrived together
                for o in outputs:
                    self._on_output(o, now)
                for (gap, n), count in self._gaps.items():  # one observation per shared gap
                    self.observer.inter_token(gap, n, count)
                self._gaps.clear()
                if outputs:
                    self.host_times.add_stream(time.perf_counter() - started)
                self.stats, self.rank_stats = stats, ranks or (stats,)
                for rank, rs in enumerate(self.rank_stats):
                    self.observer.stats(rs, rank)
                    for spans in rs.host_spans:
                        self.host_times.add_step(StepSpans(*spans))
            case Rejected(request_id=rid, message=message):
                st = self._states.pop(rid, None)
                if st is not None:
                    st.finished = True
                    st.box.put(ValueError(message))
            case CoreFailed(message=message):
                self._fail_all(message)
            case Ready():
                pass  # only at start (``start`` reads it)
            case _:
                assert_never(msg)

    def _hold(self, st: _State, o: EngineCoreOutput, now: float) -> None:
        """A collected answer's middle increment: its tokens wait for the last one."""
        assert st.last_token is not None
        self._gaps[now - st.last_token, len(o.new_token_ids)] += 1
        st.last_token = now
        st.held_ids += o.new_token_ids
        if o.new_logprobs is not None:
            if st.held_logprobs is None:
                st.held_logprobs = []
            st.held_logprobs += o.new_logprobs

    def _on_output(self, o: EngineCoreOutput, now: float) -> None:
        st = self._states.get(o.request_id)
        if st is None:
            return  # aborted here already
        if st.collect and st.last_token is not None and o.finish_reason is None and not o.error:
            self._hold(st, o, now)
            return
        if o.finish_reason == "migrate" and o.error is not None:
            # the export failed: the stream moves without its KV (recomputed where it goes)
            log.warning("request %s: moving without its KV: %s", o.request_id, o.error.message)
            o.error = None
        if o.error is not None:
            st.finished = True
            del self._states[o.request_id]
            self.observer.kv_error(o.error.reason)
            st.box.put(KVTransferError(o.error.reason, o.error.message))
            return
        if st.last_token is None:
            self.observer.first_token(now - st.arrival, st.prompt_len)
        else:
            self._gaps[now - st.last_token, len(o.new_token_ids)] += 1
        st.last_token = now
        finish = o.finish_reason
        stop_reason: str | int | None = o.stop_token_id
        # a moved request's held-back text (a partial character, a stop string's prefix) is
        # the continuing engine's to send
        final = finish is not None and finish != "migrate"
        ids, logprobs = o.new_token_ids, o.new_logprobs
        if st.held_ids:
            ids, st.held_ids = st.held_ids + ids, []
            if st.held_logprobs is not None:
                logprobs, st.held_logprobs = st.held_logprobs + (logprobs or []), None
        text = st.detok.add(ids, final=final)
        delta, stop = st.stops.update(text, final=final)
        if stop is not None:
            if finish is None:  # the core would go on: stop it
                self._send(AbortRequests([o.request_id]))
            finish, stop_reason = "stop", stop
        out = RequestOutput(
            request_id=o.request_id,
            delta_text=delta,
            delta_token_ids=list(ids),
            delta_logprobs=logprobs,
            num_prompt_tokens=st.prompt_len,
            num_output_tokens=len(st.detok.token_ids),
            num_cached_tokens=o.num_cached_tokens,
            finished=finish is not None,
            finish_reason=finish,
            stop_reason=stop_reason,
            kv_transfer_params=o.kv_transfer_params,
        )
        if finish is not None:
            st.finished = True
            del self._states[o.request_id]
            self.observer.finished(now - st.arrival, finish, st.prompt_len, out.num_output_tokens)
        st.box.put(out)
