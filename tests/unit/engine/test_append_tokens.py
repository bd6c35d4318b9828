"""A step's tokens appended up to the first that stops the request (``sched/stops.py``):
the fast path (all at once) and the token-by-token check give the same tokens and stop."""

from __future__ import annotations

import itertools

import pytest

from dsv4_serving.engine.core.sched.stops import append_tokens, check_stop
from dsv4_serving.engine.request import EngineCoreRequest, Request, RequestStatus
from dsv4_serving.engine.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

MAX_LEN = 12


def _one_by_one(req: Request, tokens: list[int]):  # type: ignore[no-untyped-def]
    new = []
    for t in tokens:
        req.all_token_ids.append(t)
        new.append(t)
        status = check_stop(req, t, MAX_LEN)
        if status is not None:
            return new, status
    return new, None


def _req(sp: SamplingParams, outputs: int) -> Request:
    req = Request(EngineCoreRequest("a", [1, 2, 3], sp), eos_token_id=9)
    req.all_token_ids.extend([5] * outputs)
    return req


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_fast_path_equals_the_token_by_token_check(ignore_eos: bool) -> None:
    cases = 0
    for max_tokens, min_tokens, outputs, stops in itertools.product(
        (2, 5, 50), (0, 3), range(5), ([], [7])
    ):
        sp = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(min_tokens, max_tokens),
            ignore_eos=ignore_eos,
            stop_token_ids=stops,
        )
        for toks in itertools.product((4, 7, 9), repeat=3):
            want_req, got_req = _req(sp, outputs), _req(sp, outputs)
            want = _one_by_one(want_req, list(toks))
            got = append_tokens(got_req, list(toks), MAX_LEN)
            assert got == want, (sp, outputs, toks)
            assert got_req.all_token_ids == want_req.all_token_ids
            cases += 1
    assert cases == 3 * 2 * 5 * 2 * 27
    # the length stop at the model's length, reached within the step's tokens
    req = _req(SamplingParams(max_tokens=100, ignore_eos=True), 7)
    assert append_tokens(req, [4, 4, 4], MAX_LEN) == ([4, 4], RequestStatus.FINISHED_LENGTH)
