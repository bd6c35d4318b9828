"""Runs one scheduled step on the device: state copies, the forward over a flat batch,
sampling / draft verification, and the MTP drafter.

The runner keeps no request state besides per-request random generators and, for requests
with penalties, token counts (``TokenHistory``, from the prompt sent at the first sample, then
each accepted token); everything else it needs (tokens, block ids, state slot) comes in the
``SchedulerOutput``.

Under tensor parallelism every TP rank runs ``execute`` on the same output (the core broadcasts
it); the head gathers the logits, so TP rank 0 alone samples (the generators live there) and
tells the others the tokens only when the MTP layer needs them. Grammars (structured
outputs) live there too (``grammars``): the core hands each request's compiled grammar over when
it accepts the request, and the runner masks that request's rows before sampling.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsv4_serving.attention.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.distributed.comm import broadcast_object
from dsv4_serving.distributed.groups import SOLO, Group
from dsv4_serving.engine.core.sched.async_scheduler import PLACEHOLDER
from dsv4_serving.engine.core.sched.scheduler import RunnerResult, ScheduledRequest, SchedulerOutput
from dsv4_serving.engine.sample.logits_processors import TokenHistory
from dsv4_serving.engine.sample.sampler import compute_logprobs, sample_and_verify
from dsv4_serving.engine.sample.sampling_params import SamplingParams
from dsv4_serving.engine.sample.seeding import position_seed
from dsv4_serving.engine.worker.block_table import BlockTable
from dsv4_serving.engine.worker.model_loader import LoadedModel
from dsv4_serving.structured.bitmask import apply_bitmask_
from dsv4_serving.structured.request_grammars import RequestGrammars

if TYPE_CHECKING:
    from dsv4_serving.engine.worker.step_graphs import StepGraphs
    from dsv4_serving.eplb.balancer import Balancer

DUMMY_REQUEST = "dsv4-dummy"  # an idle DP rank's batch: its tokens are not load


@dataclass(slots=True)
class PreparedStep:
    """A step's inputs built ahead of its run (async scheduling: on the core's thread while
    the step before it runs). ``rows``: the input rows that hold ``PLACEHOLDER``, in the order
    of the requests (``holders``: their indices in ``sched``) whose tokens fill them;
    ``contexts``: those requests' positions as prepared (with MTP the optimistic ones, all
    drafts of the step before accepted), ``counts``: their rows each."""

    sched: list[ScheduledRequest]
    input_ids: torch.Tensor
    meta: AttentionMetadata
    rows: torch.Tensor
    holders: list[int]
    contexts: list[int]
    counts: torch.Tensor
    prepare_s: float


class ModelRunner:
    def __init__(
        self,
        lm: LoadedModel,
        num_blocks: int,
        num_slots: int,
        num_speculative_tokens: int,
        seed: int = 0,
        tp: Group = SOLO,
        dummy: tuple[int, int] | None = None,
        eplb: Balancer | None = None,
    ) -> None:
        """``dummy``: the (block, state slot) kept from the scheduler for the dummy batch of an
        idle DP rank. ``eplb``: counts the real tokens' expert load and re-places experts at
        the end of forward steps (every rank of the EP group runs the same steps)."""
        self.lm = lm
        self.tp = tp
        self.dummy = dummy
        self.samples = tp.index == 0
        self.model = lm.model
        # the step's forward: the model, or a context-parallel rank's (``cp_runner``)
        self.forward: Callable[..., torch.Tensor] = lm.model
        self.graphs: StepGraphs | None = None  # the decode steps' seam (``step_graphs.py``)
        self.device = lm.device
        self.block_size = lm.block_size
        self.k = num_speculative_tokens
        self.cache = self.model.allocate_cache(
            num_blocks, lm.block_size, num_slots, lm.dtype, lookahead=self.k
        )
        self.eplb = eplb
        self.forwards = 0  # steps that ran the model (the benchmark's per-step figures)
        self.block_table = BlockTable(num_slots)
        self.prepare_s = 0.0  # the last step's input preparation (``engine/engine/host_times``)
        self._gens: dict[str, torch.Generator] = {}
        self._hists: dict[str, TokenHistory] = {}
        self._default_gen = torch.Generator().manual_seed(seed)
        self.grammars: RequestGrammars | None = None  # set by the core at its first grammar

    def _generator(self, s: ScheduledRequest) -> torch.Generator:
        seed = s.sampling_params.seed
        if seed is None:
            return self._default_gen
        g = self._gens.get(s.request_id)
        if g is None:
            g = self._gens[s.request_id] = torch.Generator()
        return g.manual_seed(position_seed(seed, s.num_output_tokens))  # sample/seeding.py

    def _positions(self, s: ScheduledRequest) -> Callable[[int], torch.Generator] | None:
        """A seeded request's generator for its step's row i: reseeded at its position."""
        seed = s.sampling_params.seed
        if seed is None:
            return None
        g, n = self._generator(s), s.num_output_tokens
        return lambda i: g.manual_seed(position_seed(seed, n + i))

    def _history(self, s: ScheduledRequest, vocab: int) -> TokenHistory | None:
        """The request's token counts (penalties only), started at its first sample."""
        if not s.sampling_params.uses_history:
            return None
        h = self._hists.get(s.request_id)
        if h is None:
            assert s.prompt_token_ids is not None, f"no prompt for {s.request_id}'s penalties"
            h = TokenHistory(s.prompt_token_ids, vocab, self.device, s.sampling_params)
            self._hists[s.request_id] = h
        return h

    def dummy_step(self) -> SchedulerOutput:
        """One token at position 0 of the reserved block and slot, sampling nothing: an idle DP
        rank's share of a step's collectives (every EP rank runs every MoE layer)."""
        assert self.dummy is not None, "no block and slot reserved for a dummy batch"
        block, slot = self.dummy
        s = ScheduledRequest(DUMMY_REQUEST, [0], 0, 0, [block], slot, False, 0, SamplingParams(), 0)
        return SchedulerOutput([s], [], [], 1)

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        mtp_chain: bool | None = None,
        prepared: PreparedStep | None = None,
        started: Callable[[], None] | None = None,
    ) -> dict[str, RunnerResult]:
        """``mtp_chain``: run the k - 1 chained MTP calls (under DP every rank must, when any
        rank drafts); None = when this batch drafts. ``prepared``: this step's inputs from
        ``prepare_ahead`` (its placeholders are filled here). ``started``: called once the
        inputs are in, as the forward starts (the step thread then hands the previous step's
        results to the core)."""
        for rid in out.finished_ids:
            self._gens.pop(rid, None)
            self._hists.pop(rid, None)
            if self.grammars is not None:
                self.grammars.drop(rid)
        for src, dst in out.state_copies:
            self.cache.copy_slot(src, dst)
        if not out.scheduled:
            return {}
        sched = out.scheduled
        self.forwards += 1
        if self.eplb is not None:
            self.eplb.begin(real=sched[0].request_id != DUMMY_REQUEST)
        input_ids, meta = self.inputs(sched, prepared)
        if started is not None:
            started()
        results = self._run(sched, input_ids, meta, mtp_chain)
        if self.eplb is not None:
            self.eplb.end_step()  # may move one MoE layer's experts: between two forwards
        return results

    def inputs(
        self, sched: list[ScheduledRequest], prepared: PreparedStep | None
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's inputs: ``prepared``'s with its placeholder rows filled from ``sched``
        (indexed writes), or prepared now; ``prepare_s`` times either."""
        started = time.perf_counter()
        if prepared is None:
            input_ids, meta = self.prepare(sched)
            self.prepare_s = time.perf_counter() - started
            return input_ids, meta
        assert prepared.sched is sched, "a step prepared for another batch"
        if prepared.holders:
            self._fill(prepared)
        self.prepare_s = prepared.prepare_s + time.perf_counter() - started
        return prepared.input_ids, prepared.meta

    def _fill(self, prepared: PreparedStep) -> None:
        """The step thread has put the previous step's tokens (and drafts) in place of the
        placeholders, and moved each such request back by the drafts it rejected: the same
        into the prepared tensors, one indexed write each (positions only when a draft was
        rejected; block tables and row offsets do not move)."""
        sched, holders = prepared.sched, prepared.holders
        vals = [t for i in holders for t in sched[i].token_ids]
        assert len(vals) == prepared.rows.numel(), "placeholder rows changed length"
        prepared.input_ids[prepared.rows] = torch.tensor(vals, dtype=torch.long, device=self.device)
        if not self.k:
            return  # without drafts a placeholder's position is exact
        ctx = prepared.meta.context_lens
        back = [c - sched[i].context_len for i, c in zip(holders, prepared.contexts, strict=True)]
        if any(back):
            for i, b in zip(holders, back, strict=True):
                ctx[i] -= b
            shift = torch.tensor(back, dtype=torch.long).repeat_interleave(prepared.counts)
            prepared.meta.positions[prepared.rows] -= shift.to(self.device)

    def prepare_ahead(self, out: SchedulerOutput) -> PreparedStep | None:
        """Async scheduling: build ``out``'s inputs on the core's thread while the step before
        it runs, all but its placeholder tokens (and with MTP, the positions the step before
        moves back by its rejected drafts: ``_fill``). The persistent block table is the
        core's alone then: the drafter reads its step's table, never the persistent one."""
        if not out.scheduled:
            return None
        started = time.perf_counter()
        sched = out.scheduled
        input_ids, meta = self.prepare(sched)
        rows: list[int] = []
        holders: list[int] = []
        contexts: list[int] = []
        counts: list[int] = []
        for i, s in enumerate(sched):
            if s.token_ids and s.token_ids[0] == PLACEHOLDER:
                a, n = meta.query_start_loc[i], len(s.token_ids)
                rows.extend(range(a, a + n))
                holders.append(i)
                contexts.append(s.context_len)
                counts.append(n)
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return PreparedStep(
            sched,
            input_ids,
            meta,
            index,
            holders,
            contexts,
            torch.tensor(counts, dtype=torch.long),
            time.perf_counter() - started,
        )

    def prepare(self, sched: list[ScheduledRequest]) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's inputs: token ids and attention metadata, block tables from the
        persistent ``BlockTable`` (only rows whose block list changed are written)."""
        ids: list[int] = []
        chunks = []
        for s in sched:
            ids.extend(s.token_ids)
            chunks.append(
                SeqChunk(s.context_len, len(s.token_ids), s.block_ids, s.state_slot, s.snapshots)
            )
        meta = self._metadata(chunks)
        return torch.tensor(ids, dtype=torch.long, device=self.device), meta

    def _metadata(self, chunks: list[SeqChunk]) -> AttentionMetadata:
        table = self.block_table.gather(chunks).to(self.device)
        return AttentionMetadata.build(chunks, self.block_size, self.device, table)

    def _run(
        self,
        sched: list[ScheduledRequest],
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        mtp_chain: bool | None,
    ) -> dict[str, RunnerResult]:
        if self.graphs is not None:
            hidden = self.graphs.step(sched, input_ids, meta, self.cache)
        else:
            hidden = self.forward(input_ids, meta, self.cache)

        # logits rows: the last num_spec + 1 rows of every request that samples
        rows: list[int] = []
        spans: list[tuple[int, int]] = []
        for i, s in enumerate(sched):
            if s.sample:
                end = meta.query_start_loc[i + 1]
                spans.append((len(rows), s.num_spec + 1))
                rows.extend(range(end - s.num_spec - 1, end))
        results: dict[str, RunnerResult] = {}
        if rows:
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
            # greedy rows: one argmax and one host copy for the whole step, not one per request
            greedy = None
            if self.samples and any(s.sample and s.sampling_params.greedy for s in sched):
                greedy = logits.argmax(dim=-1).tolist()
            j = 0
            for s in sched if self.samples else ():
                if not s.sample:
                    continue
                a, n = spans[j]
                j += 1
                lg = logits[a : a + n]
                drafts = s.token_ids[len(s.token_ids) - s.num_spec :] if s.num_spec else []
                sp = s.sampling_params
                hist = self._history(s, lg.shape[-1])
                grammar = self.grammars is not None and s.request_id in self.grammars
                if grammar:
                    toks = self._constrained(s, lg, drafts, hist)
                elif greedy is not None and sp.greedy and not drafts and not sp.moves_argmax:
                    toks = [greedy[a]]
                else:
                    toks = sample_and_verify(
                        lg, drafts, sp, self._generator(s), hist, self._positions(s)
                    )
                if hist is not None:
                    hist.add(toks)
                lp = None
                if s.sampling_params.logprobs is not None:
                    lp = compute_logprobs(lg, toks, s.sampling_params.logprobs)
                results[s.request_id] = RunnerResult(toks, lp)
        if self.k and self.lm.num_mtp_layers:
            if self.tp.size > 1:  # the MTP layer reads the sampled tokens on every TP rank
                toks = broadcast_object({r: x.token_ids for r, x in results.items()}, self.tp)
                results = {r: results.get(r) or RunnerResult(t) for r, t in toks.items()}
            self._draft(sched, meta, hidden, results, mtp_chain)
        return results

    def _constrained(
        self,
        s: ScheduledRequest,
        lg: torch.Tensor,
        drafts: list[int],
        hist: TokenHistory | None,
    ) -> list[int]:
        """Sample / verify under the request's grammar: drafts the grammar refuses are cut
        (rejected: their probability under the mask is 0), row i is masked by the grammar's
        state after the drafts before it, and the matcher advances with the verified tokens."""
        assert self.grammars is not None
        rows, kept = self.grammars.rows(s.request_id, drafts)
        masked = apply_bitmask_(lg[: kept + 1].clone(), torch.from_numpy(rows))
        toks = sample_and_verify(
            masked, drafts[:kept], s.sampling_params, self._generator(s), hist, self._positions(s)
        )
        self.grammars.advance(s.request_id, toks)
        return toks

    def _draft(
        self,
        sched: list[ScheduledRequest],
        meta: AttentionMetadata,
        hidden: torch.Tensor,
        results: dict[str, RunnerResult],
        mtp_chain: bool | None = None,
    ) -> None:
        """Run the MTP layer over every position the main model kept this step (its cache rows
        must follow the main model's), then chain it k - 1 more times for the drafts."""
        chunks: list[SeqChunk] = []
        next_ids: list[int] = []
        rows: list[int] = []
        for i, s in enumerate(sched):
            r = results.get(s.request_id)
            n = len(s.token_ids) - (s.num_spec - (len(r.token_ids) - 1) if r else 0)
            last = r.token_ids[-1] if r else s.next_token
            if last is None:  # cannot happen: a chunk that does not sample knows its next token
                raise AssertionError(f"no next token for {s.request_id}")
            a = meta.query_start_loc[i]
            # the MTP layer's state goes into the same snapshots (its rows are part of them)
            snaps = s.snapshots if n == len(s.token_ids) else ()
            chunks.append(SeqChunk(s.context_len, n, s.block_ids, s.state_slot, snaps))
            next_ids.extend(s.token_ids[1:n])
            next_ids.append(last)
            rows.extend(range(a, a + n))
        # the step's block table (same lists, same order): the persistent one may be the
        # core's meanwhile (``prepare_ahead`` of the next step)
        mmeta = AttentionMetadata.build(chunks, self.block_size, self.device, meta.block_tables)
        dev = self.device
        logits, mh = self.model.mtp_forward(
            torch.tensor(next_ids, device=dev),
            hidden[torch.tensor(rows, device=dev)],
            mmeta,
            self.cache,
        )
        last_rows = mmeta.last_token_indices()
        drafting = [i for i, s in enumerate(sched) if s.sample]
        if not drafting:
            if mtp_chain:
                self._idle_chain(mh[:1])
            return
        sel = torch.tensor(drafting, device=dev)
        draft = logits[last_rows[sel]].argmax(-1)
        h = mh[last_rows[sel]]
        drafts = [[int(t)] for t in draft.tolist()]
        if self.k > 1:  # the drafting rows of the step's table, as wide as their lists
            width = max(len(chunks[i].block_ids) for i in drafting)
            table = mmeta.block_tables[sel, : max(1, width)]
        for step in range(1, self.k):
            dchunks = []
            for i in drafting:
                c = chunks[i]
                dchunks.append(
                    SeqChunk(c.context_len + c.num_new + step - 1, 1, c.block_ids, c.state_slot)
                )
            dmeta = AttentionMetadata.build(dchunks, self.block_size, self.device, table)
            lg, h = self.model.mtp_forward(draft, h, dmeta, self.cache)
            draft = lg.argmax(-1)
            for d, t in zip(drafts, draft.tolist(), strict=True):
                d.append(int(t))
        for i, d in zip(drafting, drafts, strict=True):
            results[sched[i].request_id].draft_ids = d

    def _idle_chain(self, h: torch.Tensor) -> None:
        """The chained MTP calls on the dummy block and slot, results unused: this rank drafts
        nothing, another DP rank does, and every rank must make the same MoE calls."""
        assert self.dummy is not None, "no block and slot reserved for a dummy batch"
        if self.eplb is not None:
            self.eplb.begin(real=False)
        block, slot = self.dummy
        draft = torch.zeros(1, dtype=torch.long, device=self.device)
        for step in range(1, self.k):
            dmeta = AttentionMetadata.build(
                [SeqChunk(step, 1, [block], slot)], self.block_size, self.device
            )
            _, h = self.model.mtp_forward(draft, h, dmeta, self.cache)
