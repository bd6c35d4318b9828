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
  next step, the first that can read them through a prefix hit, runs after it. A state
  snapshot at a block boundary is taken only where the block's tokens are known when its step
  is scheduled (a boundary reached by a sampled token gets none: a later hit stops at the
  boundary before, as when the snapshot slots run out).

MTP is not scheduled asynchronously (the engine refuses the combination): how many drafts
step N accepts decides step N+1's positions.
"""

from __future__ import annotations

from dsv4_serving.engine.core.sched.scheduler import (
    RunnerResult,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
)
from dsv4_serving.engine.request import EngineCoreOutput, Request, RequestStatus

PLACEHOLDER = -1
"""A step input whose token the step in flight is still sampling (filled in by the step
thread from that step's results before this one runs)."""


class AsyncScheduler(Scheduler):
    def schedule(self, admit: bool = True) -> SchedulerOutput:
        out = super().schedule(admit)
        for s in out.scheduled:
            req = self.requests[s.request_id]
            req.num_computed_tokens += len(s.token_ids)
            if s.sample:
                req.num_output_placeholders += 1
            # its state-slot copy at an exact boundary goes before the next forward
            self.kv.cache_blocks(req)
        return out

    def _waits_for_output(self, req: Request) -> bool:
        """The step in flight samples the last token ``req`` may have."""
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
        holes = req.num_computed_tokens + num_new - req.num_tokens
        if holes <= 0:
            return super()._describe(req, num_new)
        assert holes == req.num_output_placeholders == 1, (req, num_new)
        assert not req.spec_token_ids, "MTP drafts under async scheduling"
        ctx = req.num_computed_tokens
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=[*req.all_token_ids[ctx:], PLACEHOLDER],
            context_len=ctx,
            num_spec=0,
            block_ids=self.kv.block_ids(req.request_id),
            state_slot=self.kv.req_slot[req.request_id],
            sample=True,
            next_token=None,
            sampling_params=req.sampling_params,
            num_output_tokens=req.num_output_tokens + 1,
        )

    def update_from_output(
        self, out: SchedulerOutput, results: dict[str, RunnerResult]
    ) -> list[EngineCoreOutput]:
        """Step ``out``'s sampled tokens (its inputs were counted when it was scheduled)."""
        outputs = []
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or not s.sample:
                continue  # gone (stopped a step earlier, aborted): its token is dropped
            (token,) = results[s.request_id].token_ids
            lp = results[s.request_id].logprobs
            req.num_output_placeholders -= 1
            req.all_token_ids.append(token)
            status = self._check_stop(req, token)
            o = EngineCoreOutput(
                req.request_id, [token], lp, num_cached_tokens=max(req.num_cached_tokens, 0)
            )
            if status is not None:
                if req.status is RequestStatus.RUNNING:
                    self.running.remove(req)
                else:  # preempted while its step was in flight
                    self.waiting.remove(req)
                self._finish(req, status)
                o.finish_reason = status.value
                o.stop_token_id = req.stop_token_id
            outputs.append(o)
        outputs.extend(self.take_extra_outputs())
        self._refresh_stats()
        return outputs
