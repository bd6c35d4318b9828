"""The front end's handle on the engine core process: requests in, text increments out.

The core runs in a child process (spawned, so it owns its torch state and threads); two
multiprocessing queues connect them. A reader thread hands core messages to the event loop.
Detokenization and stop strings happen here, as in vLLM's output processor: when a stop string
appears the request is finished here and aborted in the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from dsv4_serving.engine.config import EngineConfig
from dsv4_serving.engine.engine_core import EngineInfo, run_engine_core
from dsv4_serving.engine.request import EngineCoreOutput, EngineCoreRequest, Logprob
from dsv4_serving.engine.sampling_params import SamplingParams
from dsv4_serving.engine.scheduler import SchedulerStats
from dsv4_serving.engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class KVTransferError(RuntimeError):
    """A PD request's KV could not be exported (prefill) or pulled (decode, policy fail)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class RequestOutput:
    """One increment of a request, as the API layer streams it."""

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    delta_logprobs: list[Logprob] | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill's, for the remote decode


@dataclass(slots=True)
class _State:
    prompt_len: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    q: asyncio.Queue[RequestOutput | Exception] = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    last_token: float | None = None
    sent: int = 0  # characters of text already sent
    finished: bool = False


# on_output(kind, **values) is how metrics learn what happened (kept free of prometheus here)
MetricsHook = Callable[..., None]


class AsyncLLM:
    def __init__(
        self, config: EngineConfig, tokenizer: Tokenizer, on_event: MetricsHook | None = None
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.on_event = on_event or (lambda *a, **k: None)
        self.info: EngineInfo | None = None
        self.stats = SchedulerStats()
        self._states: dict[str, _State] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: Any = None
        self._reader: threading.Thread | None = None
        self._closing = False
        self.dead_reason: str | None = None
        self._ids = itertools.count()

    # ---- lifecycle --------------------------------------------------------------------

    def start(self, timeout_s: float = 600.0) -> EngineInfo:
        """Spawn the core and wait until it has loaded the model (blocking)."""
        ctx = mp.get_context("spawn")
        self._in: Any = ctx.Queue()
        self._out: Any = ctx.Queue()
        self._proc = ctx.Process(
            target=run_engine_core, args=(self.config, self._in, self._out), daemon=True,
            name="dsv4-engine-core",
        )  # fmt: skip
        self._proc.start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self._out.get(timeout=0.5)
                break
            except queue.Empty:
                if not self._proc.is_alive():
                    raise EngineDeadError(
                        f"engine core exited with code {self._proc.exitcode} while starting"
                    ) from None
                if time.monotonic() > deadline:
                    self.shutdown()
                    raise EngineDeadError(f"engine core not ready after {timeout_s}s") from None
        if msg[0] == "error":
            self.shutdown()
            raise EngineDeadError(f"engine core failed to start: {msg[1]}")
        self.info = msg[1]
        return msg[1]

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start delivering core messages to ``loop`` (call from inside it)."""
        self._loop = loop
        self._reader = threading.Thread(target=self._read, name="dsv4-core-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive() and self.dead_reason is None

    def shutdown(self) -> None:
        self._closing = True
        if self._proc is None:
            return
        if self._proc.is_alive():
            with contextlib.suppress(OSError, ValueError):
                self._in.put(("shutdown", None))
            self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        if self._reader is not None:
            self._reader.join(timeout=2)

    def _read(self) -> None:
        assert self._loop is not None
        while not self._closing:
            try:
                msg = self._out.get(timeout=0.5)
            except queue.Empty:
                if not self._proc.is_alive() and not self._closing:
                    reason = f"engine core died (exit code {self._proc.exitcode})"
                    self._loop.call_soon_threadsafe(self._fail_all, reason)
                    return
                continue
            except (EOFError, OSError):
                return
            self._loop.call_soon_threadsafe(self._dispatch, msg)

    # ---- requests ---------------------------------------------------------------------

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}-{next(self._ids)}"

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Increments until the request finishes; closing the iterator early aborts it."""
        if not self.alive:
            raise EngineDeadError(self.dead_reason or "engine core is not running")
        st = _State(len(prompt_token_ids), params, IncrementalDetokenizer(self.tokenizer))
        self._states[request_id] = st
        req = EngineCoreRequest(
            request_id, list(prompt_token_ids), params, kv_transfer_params=kv_transfer_params
        )
        self._in.put(("add", req))
        try:
            while True:
                item = await st.q.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not st.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        st = self._states.pop(request_id, None)
        if st is not None:
            st.finished = True
            self.on_event("abort")
        if self.alive:
            self._in.put(("abort", [request_id]))

    # ---- messages from the core (event loop thread) -----------------------------------

    def _fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        for st in self._states.values():
            st.finished = True
            st.q.put_nowait(EngineDeadError(reason))
        self._states.clear()

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "outputs":
            for o in msg[1]:
                self._on_output(o)
            self.stats = msg[2]
            self.on_event("stats", stats=msg[2])
        elif kind == "reject":
            st = self._states.pop(msg[1], None)
            if st is not None:
                st.finished = True
                st.q.put_nowait(ValueError(msg[2]))
        elif kind == "error":
            self._fail_all(str(msg[1]))

    def _on_output(self, o: EngineCoreOutput) -> None:
        st = self._states.get(o.request_id)
        if st is None:
            return  # aborted here already
        now = time.monotonic()
        if o.error is not None:
            st.finished = True
            del self._states[o.request_id]
            self.on_event("kv_error", reason=o.error[0])
            st.q.put_nowait(KVTransferError(*o.error))
            return
        if st.last_token is None:
            self.on_event("first_token", seconds=now - st.arrival, prompt_tokens=st.prompt_len)
        else:
            self.on_event("inter_token", seconds=now - st.last_token, n=len(o.new_token_ids))
        st.last_token = now
        finish, stop_reason = o.finish_reason, o.stop_token_id
        text = st.detok.add(o.new_token_ids, final=finish is not None)
        if st.params.stop and finish != "abort":
            hit = _find_stop(text, st.params.stop, max(0, st.sent - _longest(st.params.stop)))
            if hit is not None:
                text, stop_reason = text[: hit[0]], hit[1]
                if finish is None:
                    self._in.put(("abort", [o.request_id]))
                finish = "stop"
            elif finish is None:
                # hold back what could be the start of a stop string
                text = text[: max(st.sent, len(text) - _longest(st.params.stop) + 1)]
        delta = text[st.sent :]
        st.sent = len(text)
        out = RequestOutput(
            request_id=o.request_id,
            delta_text=delta,
            delta_token_ids=list(o.new_token_ids),
            delta_logprobs=o.new_logprobs,
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
            self.on_event(
                "finished", seconds=now - st.arrival, reason=finish,
                prompt_tokens=st.prompt_len, generation_tokens=out.num_output_tokens,
            )  # fmt: skip
        st.q.put_nowait(out)


def _longest(stops: list[str]) -> int:
    return max(len(s) for s in stops)


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
