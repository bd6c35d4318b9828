"""A real ``dsv4 engine`` process in the EMULATED step-time mode (``--emulate-step-time``): it
says so on /metrics and in its log, serves the OpenAI API with the deterministic token chain,
each step takes its modelled time, and the real scheduler batches concurrent requests."""

from __future__ import annotations

import concurrent.futures
import time

import httpx

from dsv4_common.process import Service
from dsv4_serving.engine.emulated.runner import emulated_token
from dsv4_serving.presets import preset_config

ENGINE_ARGS = ["--model", "dsv4-tiny", "--served-model-name", "tiny", "--num-kv-blocks", "200"]
ENGINE_ARGS += ["--max-model-len", "1024", "--num-speculative-tokens", "0"]
ENGINE_ARGS += ["--emulate-step-time", "50,1,0.1"]


def _complete(url: str, prompt: list[int], n: int) -> tuple[list[int], float]:
    t = time.monotonic()
    r = httpx.post(
        f"{url}/v1/completions",
        json={
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": n,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=60,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"], time.monotonic() - t


def test_emulated_engine_labels_itself_and_serves_the_token_chain(engine_server: Service) -> None:
    url = engine_server.url
    text = httpx.get(f"{url}/metrics", timeout=10).text
    line = 'dsv4_engine_emulated_step_time{base_ms="50",per_seq_ms="1",per_token_ms="0.1"} 1.0'
    assert line in text
    assert "EMULATED engine" in engine_server.log_path.read_text()

    cfg = preset_config("dsv4-tiny")
    eos = cfg["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    prompt = [5, 17, 230, 41, 9]
    want, prev = [], prompt[-1]
    for pos in range(len(prompt), len(prompt) + 16):
        prev = emulated_token(pos, prev, int(cfg["vocab_size"]), eos)
        want.append(prev)
    got, alone_s = _complete(url, prompt, 16)
    assert got == want
    # 16 steps of at least 50 ms each (one token per step without drafts)
    assert alone_s >= 16 * 0.051

    # 8 at once share their steps (the real scheduler batches them): far less than 8 x alone
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        t = time.monotonic()
        outs = list(pool.map(lambda i: _complete(url, [i + 3, 7, 9], 16), range(8)))
        together_s = time.monotonic() - t
    assert all(len(toks) == 16 for toks, _ in outs)
    assert together_s < 3 * alone_s, (together_s, alone_s)
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'vllm:generation_tokens_total{model_name="tiny"} 144.0' in metrics


def test_host_times_count_every_phase_of_the_steps(engine_server: Service) -> None:
    """``GET /debug/host_times``: the core's spans of each step reach the front end, which adds
    its stream time; ``reset=true`` starts a new window."""
    url = engine_server.url
    httpx.get(f"{url}/debug/host_times", params={"reset": "true"}, timeout=10).raise_for_status()
    assert all(v["count"] == 0 for v in httpx.get(f"{url}/debug/host_times").json().values())
    _complete(url, [5, 6, 7], 4)  # 4 steps: the prompt's, then 3 decode steps
    got = httpx.get(f"{url}/debug/host_times", timeout=10).json()
    assert set(got) == {"schedule", "prepare", "post_process", "stream"}
    assert got["schedule"]["count"] == got["prepare"]["count"] == 4
    assert got["post_process"]["count"] == got["stream"]["count"] == 4
    for phase in ("schedule", "prepare", "post_process", "stream"):
        assert 0 < got[phase]["p50_ms"] <= got[phase]["p99_ms"] < 1000, got


def test_emulated_core_gives_the_same_tokens_with_mtp_drafts_in_fewer_steps() -> None:
    """The drafts are the chain's next tokens, so all are accepted: same output, fewer steps."""
    from dsv4_serving.engine.config import EngineConfig
    from dsv4_serving.engine.engine.engine_core import EngineCore
    from tests.engine.common import run, workload

    work = workload(6, seed=1)
    outs, steps = {}, {}
    for k in (0, 1):
        core = EngineCore(
            EngineConfig(
                model="dsv4-tiny",
                num_kv_blocks=200,
                max_model_len=1024,
                num_speculative_tokens=k,
                emulate_step_time="1,0,0",
            )
        )
        outs[k] = run(core, work)
        steps[k] = core.runner.forwards
    assert outs[0] == outs[1]
    assert [len(v) for v in outs[0].values()] == [mt for _, mt in work]
    assert steps[1] < steps[0]


def test_emulated_pd_pulls_real_kv_through_the_sidecars(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Prefill and decode both EMULATED, behind a gateway: the decode engine pulls the prefill's
    KV bytes through the real sidecars (no recompute) and continues the exact chain."""
    from tests.gateway.conftest import gateway, pd_pair, running

    token = tmp_path / "kv-token"
    token.write_text("k" * 32)
    args = ["--emulate-step-time", "5,1,0.1", "--num-speculative-tokens", "0"]
    args += ["--num-kv-blocks", "200", "--max-model-len", "1024", "--served-model-name", "tiny"]
    ps, pe = pd_pair("emu-prefill", "prefill", token, *args)
    ds, de = pd_pair("emu-decode", "decode", token, *args)
    cfg = preset_config("dsv4-tiny")
    eos = cfg["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    prompt = [5, 17, 230, 41, 9]
    want, prev = [], prompt[-1]
    for pos in range(len(prompt), len(prompt) + 8):
        prev = emulated_token(pos, prev, int(cfg["vocab_size"]), eos)
        want.append(prev)
    with (
        running(ps, ds, pe, de),
        running(gateway("emu-gw", "--prefill", pe.url, "--decode", de.url)) as (g,),
    ):
        assert _complete(g.url, prompt, 8)[0] == want
        assert de.metric("dsv4_kv_engine_transfers_total") == 1
        assert de.metric("dsv4_kv_engine_bytes_total") > 0
        assert de.metric("dsv4_kv_recomputes_total") == 0
