"""Async scheduling (``--async-scheduling``), vLLM v1's ``AsyncScheduler``: step N+1 is
scheduled while step N runs, before N's sampled tokens are known. Pure Python.

A step that samples a request leaves an **output placeholder** on it
(``Request.num_output_placeholders``) and counts its input as computed at once, so the next
schedule gives the request its next position with the token still unknown: that input is
``PLACEHOLDER``, and the step thread puts step N's sampled token there before it runs N+1
(``worker/step_thread.py``). N's outputs are taken (``update_from_output``) after N+1 was
scheduled; each token taken resolves one placeholder.

Exactness, where the synchronous scheduler would have decided with N's token in hand:
- a request that stops on N's token (EOS, a stop token) was already scheduled in N+1: that
  step's token for it is dropped (the request is gone when N+1's outputs are taken), and its
  blocks and slot were freed when N's token stopped it. N+1 still writes that request's last
  position into them, but every step runs after the one before on one thread, so whoever gets
  them next writes over them before reading them;
- a request whose known stop comes with N's token (``max_tokens``, the model length) is not
  scheduled in N+1 at all (``_waits_for_output``): no step beyond its end, so a prefill's
  exported KV and state slot are exactly the synchronous engine's;
- a request preempted while its step is in flight keeps its placeholder: N's token is still
  appended when it arrives, and the request is not re-admitted before (``_admit``);
- blocks are published (prefix cache) when their step is scheduled, not when it returned: the
  next step, the first that can read them through a prefix hit, runs after it. A boundary
  reached by a token still being sampled gets its snapshot slot reserved by the step that may
  start there (``landing``): the step thread copies the state into it before that step's
  forward if it does start there, and the boundary is published once its tokens are taken
  (``KVCacheManager.landed``), so the snapshots are the synchronous engine's.

With MTP a step that samples a request also verifies its drafts and makes the next ones, so
how many of N's drafts are accepted (and which drafts N+1 verifies) is unknown when N+1 is
scheduled. As vLLM does, N+1 is scheduled as if every draft of N were accepted: N leaves
``1 + num_spec`` placeholders (the most tokens it can produce), the request's drafts are
``num_speculative_tokens`` placeholders, and N+1's inputs are ``1 + num_spec`` placeholders at
the optimistic position. The step thread, which has N's results before it runs N+1, writes
N's sampled token and new drafts into them and moves N+1's position back by the drafts N
rejected (``step_thread.fill_placeholders``), so N+1 runs exactly the synchronous engine's
step; taking N's outputs moves ``num_computed_tokens`` back the same way. Rejected positions'
KV and state rows are overwritten by the next step, as synchronously. The blocks of N+1 were
allocated for the optimistic position, a superset of what it uses.
"""

from __future__ import annotations

from dsv4_serving.engine.core.sched.scheduler import (
    RunnerResult,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
)
from dsv4_serving.engine.core.sched.stops import append_tokens
from dsv4_serving.engine.request import EngineCoreOutput, Request, RequestStatus

PLACEHOLDER = -1
"""A step input whose token the step in flight is still sampling (filled in by the step
thread from that step's results before this one runs)."""


class AsyncScheduler(Scheduler):
    def schedule(self, admit: bool = True) -> SchedulerOutput:
        out = super().schedule(admit)
        k = self.config.num_speculative_tokens
        for s in out.scheduled:
            req = self.requests[s.request_id]
            req.num_computed_tokens += len(s.token_ids)
            if s.sample:
                # the most this step can produce: its drafts all accepted, and one token
                req.num_output_placeholders += 1 + s.num_spec
                if k:
                    req.spec_token_ids = [PLACEHOLDER] * k  # the drafts this step makes
            # its state-slot copy at an exact boundary goes before the next forward
            self.kv.cache_blocks(req)
        return out

    def _waits_for_output(self, req: Request) -> bool:
        """The step in flight may sample the last token ``req`` may have."""
        n = req.num_output_placeholders
        if not n:
            return False
        max_tokens = req.sampling_params.max_tokens
        return (
            req.num_output_tokens + n >= max_tokens
            or req.num_tokens + n >= self.config.max_model_len
        )

    def _admit(self, req: Request, budget: int, plan: list[tuple[Request, int]]) -> int | None:
        if req.num_output_placeholders:
            return None  # preempted with its token in flight: recompute once it is known
        return super()._admit(req, budget, plan)

    def _describe(self, req: Request, num_new: int) -> ScheduledRequest:
        s = self._describe_inputs(req, num_new)
        # it starts where the step in flight leaves it: at most its drafts before ``ctx``
        n = req.num_output_placeholders
        s.landing = self.kv.reserve_landing(req, s.context_len - max(n - 1, 0), s.context_len)
        return s

    def _describe_inputs(self, req: Request, num_new: int) -> ScheduledRequest:
        if not req.num_output_placeholders:
            return super()._describe(req, num_new)
        # the step in flight samples this request: every input here is a token (or draft) it
        # produces, at the position it reaches with all its drafts accepted
        ctx = req.num_computed_tokens
        assert ctx >= req.num_tokens and num_new >= 1, (req, num_new)
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=[PLACEHOLDER] * num_new,
            context_len=ctx,
            num_spec=num_new - 1,
            block_ids=self.kv.block_ids(req.request_id),
            state_slot=self.kv.req_slot[req.request_id],
            sample=True,
            next_token=None,
            sampling_params=req.sampling_params,
            num_output_tokens=req.num_output_tokens,  # the step thread adds the step's tokens
        )

    def update_from_output(
        self, out: SchedulerOutput, results: dict[str, RunnerResult]
    ) -> list[EngineCoreOutput]:
        """Step ``out``'s sampled tokens (its inputs were counted when it was scheduled)."""
        outputs = []
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is not None and s.landing is not None:
                # before its tokens: a request that stops on them still had the boundary
                self.kv.landed(req, s.landing, s.context_len)
            if req is None or not s.sample:
                continue  # gone (stopped a step earlier, aborted): its token is dropped
            outputs.append(self._take(req, s, results[s.request_id]))
        outputs.extend(self.take_extra_outputs())
        self._refresh_stats()
        return outputs

    def _take(self, req: Request, s: ScheduledRequest, r: RunnerResult) -> EngineCoreOutput:
        """One request's tokens of a step: placeholders resolved, rejected drafts uncounted."""
        accepted = len(r.token_ids) - 1
        if s.num_spec:
            self.stats.spec_drafts += 1
            self.stats.spec_draft_tokens += s.num_spec
            self.stats.spec_accepted_tokens += accepted
        req.num_output_placeholders -= 1 + s.num_spec
        running = req.status is RequestStatus.RUNNING
        if running:  # (a preempted request starts again from 0)
            req.num_computed_tokens -= s.num_spec - accepted
        new, status = append_tokens(req, r.token_ids, self.config.max_model_len)
        lp = r.logprobs[: len(new)] if r.logprobs is not None else None
        o = EngineCoreOutput(
            req.request_id, new, lp, num_cached_tokens=max(req.num_cached_tokens, 0)
        )
        if status is not None:
            if running:
                end = s.context_len + len(s.token_ids) - s.num_spec + accepted
                self.kv.snapshot_end(req, end, in_flight=req.num_output_placeholders > 0)
                self.running.remove(req)
            else:  # preempted while its step was in flight
                self.waiting.remove(req)
            self._finish(req, status)
            o.finish_reason = status.value
            o.stop_token_id = req.stop_token_id
        elif running and not req.num_output_placeholders and self.config.num_speculative_tokens:
            # not in the step now running: the next schedule verifies these drafts itself
            req.spec_token_ids = list(r.draft_ids)
        return o
