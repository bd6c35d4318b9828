"""benchmarks/sessions.py's pure pieces: reusable-token accounting per mode, a turn's row, the
goal checks and the side-by-side table, with exact numbers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def _load() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("bench_sessions", BENCHMARKS / "sessions.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module
    spec.loader.exec_module(mod)
    return mod


S = _load()

# turn 1: prompt [BOS sys sys U1 A THINK_END], answer [a1 a2 a3] (a3 sampled, never fed back)
PREV_PROMPT = [0, 5, 5, 11, 3, 4]
PREV_ANSWER = [21, 22, 23]
# turn 2 re-renders the history: the answer, its end-of-sentence, the new message
PROMPT = [0, 5, 5, 11, 3, 4, 21, 22, 23, 1, 12, 3, 4]


def test_common_prefix() -> None:
    assert S.common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert S.common_prefix([1, 2], [1, 2, 3]) == 2
    assert S.common_prefix([], [1]) == 0
    assert S.common_prefix([7], [8]) == 0


def test_colocated_reuses_the_previous_answer_but_its_last_token() -> None:
    # the engine computed the prompt and a1, a2 (a3's KV is never written)
    assert S.reusable_tokens("colocated", PREV_PROMPT, PREV_ANSWER, PROMPT) == 8


def test_pd_reuses_the_previous_prompt_only() -> None:
    # the prefill instance never saw the answer: it was decoded elsewhere
    assert S.reusable_tokens("pd", PREV_PROMPT, PREV_ANSWER, PROMPT) == 6


def test_an_answer_that_re_encodes_differently_stops_the_reuse() -> None:
    # the client's text of a2 encodes as another id: the history diverges there
    prompt = [*PREV_PROMPT, 21, 99, 23, 1, 12]
    assert S.reusable_tokens("colocated", PREV_PROMPT, PREV_ANSWER, prompt) == 7


def test_thinking_on_reuses_up_to_the_dropped_reasoning() -> None:
    # the previous prompt ended in <think> (9); the history renders </think> (4): one fewer
    prev = [0, 5, 11, 3, 9]
    prompt = [0, 5, 11, 3, 4, 21, 1, 12, 3, 9]
    assert S.reusable_tokens("colocated", prev, [30, 31], prompt) == 4
    assert S.reusable_tokens("pd", prev, [30, 31], prompt) == 4


def _turn(session: int, turn: int, ttft: float, **kw: int | None) -> object:
    return S.Turn(session, turn, ok=True, ttft=ttft, **kw)


def test_affinity_needs_a_hit_beyond_what_other_sessions_share() -> None:
    assert S.affine(_turn(0, 2, 0.1, reusable=100, shared=40, cached_tokens=96)) is True
    assert S.affine(_turn(0, 2, 0.1, reusable=100, shared=40, cached_tokens=32)) is False
    # undecidable: no report, the first turn, or nothing of its own beyond the shared part
    assert S.affine(_turn(0, 2, 0.1, reusable=100, shared=40, cached_tokens=None)) is None
    assert S.affine(_turn(0, 1, 0.1, reusable=0, shared=40, cached_tokens=32)) is None
    assert S.affine(_turn(0, 2, 0.1, reusable=40, shared=40, cached_tokens=32)) is None


def test_turn_row() -> None:
    turns = [
        _turn(0, 2, 0.1, prompt_tokens=120, reusable=100, shared=40, cached_tokens=96),
        _turn(1, 2, 0.3, prompt_tokens=140, reusable=110, shared=40, cached_tokens=32),
        S.Turn(2, 2, ok=False, error="HTTP 500", reusable=90),
    ]
    row = S.turn_row(turns, queried=260.0, hit=128.0)
    assert row == {
        "turn": 2,
        "requests": 3,
        "failed": 1,
        "ttft_p50_s": pytest.approx(0.2),
        "ttft_p99_s": pytest.approx(0.298),
        "context_tokens_mean": 130.0,
        "reusable_tokens": 300,
        "queried_tokens": 260,
        "hit_tokens": 128,
        "hit_ratio": pytest.approx(128 / 300),
        "recomputed_tokens": 132,
        "reported_cached_tokens": 128,
        "affine": "1/2",
    }


def _row(turn: int, ttft: float, reusable: int, hit: int) -> dict[str, object]:
    return {"turn": turn, "ttft_p50_s": ttft, "reusable_tokens": reusable, "hit_tokens": hit}


def test_goal_checks_pass_and_fail_with_their_numbers() -> None:
    rows = [_row(1, 0.10, 0, 64), _row(2, 0.12, 400, 384), _row(3, 0.19, 800, 736)]
    g = S.goal_checks(rows)
    # turn 1's hits (another session's system prompt) are not counted
    assert g["prefix_hit_ratio"]["hits"] == 1120 and g["prefix_hit_ratio"]["reusable"] == 1200
    assert g["prefix_hit_ratio"]["value"] == pytest.approx(1120 / 1200)
    assert g["prefix_hit_ratio"]["pass"] is True
    assert g["ttft_growth"]["value"] == pytest.approx(1.9)
    assert g["ttft_growth"]["last_turn"] == 3 and g["ttft_growth"]["pass"] is True
    slow = S.goal_checks([_row(1, 0.10, 0, 0), _row(2, 0.25, 400, 300)])
    assert slow["prefix_hit_ratio"]["value"] == 0.75 and slow["prefix_hit_ratio"]["pass"] is False
    assert slow["ttft_growth"]["value"] == pytest.approx(2.5)
    assert slow["ttft_growth"]["pass"] is False


def test_one_turn_checks_nothing() -> None:
    g = S.goal_checks([_row(1, 0.1, 0, 0)])
    assert g["prefix_hit_ratio"]["value"] is None and g["prefix_hit_ratio"]["pass"] is False
    assert g["ttft_growth"]["value"] is None and g["ttft_growth"]["pass"] is False


def test_the_table_puts_the_modes_side_by_side() -> None:
    turns = [_turn(0, 1, 0.25, prompt_tokens=50, cached_tokens=0)]
    row1 = S.turn_row(turns, 50.0, 0.0)
    row2 = S.turn_row([_turn(0, 2, 0.2, prompt_tokens=90, reusable=60, cached_tokens=48)], 90, 48)
    lines = S.format_table({"colocated": [row1, row2], "pd": [row1]}).splitlines()
    assert len(lines) == 4
    assert lines[0].split() == ["colocated", "|", "pd"]
    first = ["1", "250", "250", "50", "0", "0", "-", "50", "0", "n/a"]
    second = ["2", "200", "200", "90", "60", "48", "0.80", "42", "48", "1/1"]
    assert lines[2].split("|")[0].split() == first
    assert lines[2].split("|")[1].split() == first[1:]
    assert lines[3].split("|")[0].split() == second
    assert lines[3].split("|")[1].strip() == ""
