"""The OpenAI SDK against a real engine process: completions and chat, streaming and not,
concurrency, stop strings, logprobs, seeds, bad input (400s), disconnects (blocks freed)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from dsv4_common.process import Service

MODEL = "tiny"
ENGINE_ARGS = [
    "--model",
    "dsv4-tiny",
    "--served-model-name",
    MODEL,
    "--num-kv-blocks",
    "400",
    "--max-model-len",
    "512",
    "--max-num-batched-tokens",
    "96",
    "--num-speculative-tokens",
    "1",
]


@pytest.fixture(scope="module")
def client(engine_server: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine_server.url + "/v1", api_key="x", max_retries=0)


def wait_blocks_free(server: Service, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    total = server.metric("dsv4_kv_cache_total_blocks")
    while time.monotonic() < deadline:
        if (
            server.metric("dsv4_kv_cache_free_blocks") == total
            and server.metric("vllm:num_requests_running") == 0
            and server.metric("vllm:num_requests_waiting") == 0
        ):
            return
        time.sleep(0.2)
    raise AssertionError(f"blocks not freed: {server.metric('dsv4_kv_cache_free_blocks')}/{total}")


def test_models_and_health(client: openai.OpenAI, engine_server: Service) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(engine_server.url + "/health").status_code == 200


def test_completion_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    kw = {
        "model": MODEL,
        "prompt": "The quick brown fox",
        "max_tokens": 12,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.completions.create(**kw)
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming_and_not(client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 6
    s = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    # dsv4-tiny speaks V4's chat format, thinking by default: the answer may be reasoning
    reasoning, content = "", ""
    for c in s:
        reasoning += getattr(c.choices[0].delta, "reasoning_content", None) or ""
        content += c.choices[0].delta.content or ""
    msg = r.choices[0].message
    assert (reasoning, content) == (
        getattr(msg, "reasoning_content", None) or "",
        msg.content or "",
    )


def test_sse_ends_with_done(engine_server: Service) -> None:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", engine_server.url + "/v1/completions", json=body) as r:
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)


def test_concurrent_requests_equal_requests_alone(
    client: openai.OpenAI, engine_server: Service
) -> None:
    prompts = [("x" * (3 + 11 * i)) + str(i) for i in range(32)]
    aclient = openai.AsyncOpenAI(base_url=engine_server.url + "/v1", api_key="x", max_retries=0)

    async def one(p: str, i: int) -> list[str]:
        kw = {
            "model": MODEL,
            "prompt": p,
            "max_tokens": 4 + i % 5,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        if i % 2:
            r = await aclient.completions.create(**kw)
            return [r.choices[0].text]
        s = await aclient.completions.create(**kw, stream=True)
        return ["".join([c.choices[0].text async for c in s])]

    async def all_() -> list[list[str]]:
        return await asyncio.gather(*(one(p, i) for i, p in enumerate(prompts)))

    together = asyncio.run(asyncio.wait_for(all_(), 180))
    for i, p in enumerate(prompts):
        r = client.completions.create(
            model=MODEL,
            prompt=p,
            max_tokens=4 + i % 5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert together[i] == [r.choices[0].text], i
    wait_blocks_free(engine_server)


GREEDY = {
    "model": MODEL,
    "prompt": "stop test",
    "max_tokens": 20,
    "temperature": 0,
    "extra_body": {"ignore_eos": True},
}


@pytest.fixture(scope="module")
def stop_case(client: openai.OpenAI) -> tuple[str, str]:
    """GREEDY's text without stop strings, and a stop string found in it."""
    text = client.completions.create(**GREEDY).choices[0].text
    return text, text[5:7]


def test_a_stop_string_truncates_the_text_before_it(
    client: openai.OpenAI, stop_case: tuple[str, str]
) -> None:
    text, stop = stop_case
    r = client.completions.create(**GREEDY, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.find(stop)]


def test_a_streamed_stop_string_is_never_sent(
    client: openai.OpenAI, stop_case: tuple[str, str]
) -> None:
    text, stop = stop_case
    chunks = [c.choices[0] for c in client.completions.create(**GREEDY, stop=[stop], stream=True)]
    assert "".join(c.text for c in chunks) == text[: text.find(stop)]
    assert chunks[-1].finish_reason == "stop"


def test_logprobs_cover_every_token_with_at_most_the_asked_alternatives(
    client: openai.OpenAI,
) -> None:
    lp = client.completions.create(**GREEDY, logprobs=3).choices[0].logprobs
    # the sampled token and the 3 most likely (OpenAI: up to logprobs + 1 entries)
    assert len(lp.token_logprobs) == 20 and all(3 <= len(t) <= 4 for t in lp.top_logprobs)


def _sampled_and_distinct(lp: Any, ids: list[int], as_ids: bool) -> None:
    """Every step's dict holds the sampled token (under its own spelling, with its logprob)
    and one key per token id: none overwrote another."""
    for step, (tok, value, top, tid) in enumerate(
        zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, ids, strict=True)
    ):
        assert top[tok] == value, step
        if as_ids:
            assert tok == f"token_id:{tid}" and all(k.startswith("token_id:") for k in top)
        # 5 alternatives + the sampled one, unless it is among them: never fewer (a collision)
        assert len(top) in (5, 6), (step, top)


def test_logprobs_keys_never_collide_and_hold_the_sampled_token(client: openai.OpenAI) -> None:
    # dsv4-tiny's bytes 128-255 all decode to U+FFFD on their own: text keys would collide
    body = {**GREEDY, "prompt": "\u00e9t\u00e9 \u4e2d\u6587", "temperature": 1.0, "seed": 3}
    body["extra_body"] = {"ignore_eos": True, "return_token_ids": True}
    for as_ids in (False, True):
        extra = {**body["extra_body"], "return_tokens_as_token_ids": as_ids}
        c = client.completions.create(**{**body, "extra_body": extra}, logprobs=5).choices[0]
        ids = c.token_ids  # type: ignore[attr-defined]
        _sampled_and_distinct(c.logprobs, ids, as_ids)
        # text_offset: where each token's text starts in the answer's text
        offsets = c.logprobs.text_offset
        assert len(offsets) == 20 and offsets[0] == 0
        assert offsets == sorted(offsets) and offsets[-1] <= len(c.text)


def test_chat_logprobs_name_every_token(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=12,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 12
    for e in content:
        assert len(e.top_logprobs) == 2
        assert e.bytes is None or bytes(e.bytes).decode() == e.token
        assert e.bytes is not None or e.token.startswith("token_id:")


def test_n_samples_are_the_seeded_samples_sharing_the_prompt(
    client: openai.OpenAI, engine_server: Service
) -> None:
    sk: dict[str, Any] = {
        "model": MODEL,
        # 315 tokens: two full blocks of 128, cached once sample 0 has computed them
        "prompt": "a third prompt, the one fanned out " * 9,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 11,
        "extra_body": {"ignore_eos": True},
    }
    hits = engine_server.metric("vllm:prefix_cache_hits_total")
    r = client.completions.create(**sk, n=3)
    # samples 1 and 2 found the prompt's full blocks that sample 0 computed
    assert engine_server.metric("vllm:prefix_cache_hits_total") - hits >= 2 * 256
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage is not None and r.usage.completion_tokens == 18
    assert r.usage.prompt_tokens == len(sk["prompt"].encode())
    details = r.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= 256
    alone = [client.completions.create(**{**sk, "seed": 11 + i}).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == alone  # sample i is seed + i (vLLM's rule)
    assert len(set(alone)) > 1
    # streamed: the same samples, chunk by chunk, each with its index
    texts = ["", "", ""]
    finished = set()
    for chunk in client.completions.create(**sk, n=3, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert texts == alone and finished == {0, 1, 2}
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        n=2,
        seed=1,
        temperature=1.0,
    )
    assert [c.index for c in chat.choices] == [0, 1]
    wait_blocks_free(engine_server)


def test_the_same_seed_samples_the_same_text(client: openai.OpenAI) -> None:
    sk = {
        "model": MODEL,
        "prompt": "seeded",
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 5,
        "extra_body": {"ignore_eos": True},
    }
    a, b = (client.completions.create(**sk).choices[0].text for _ in range(2))
    assert a == b


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"model": "no-such-model", "prompt": "hi"}, "model_not_found", "model"),
        ({"model": MODEL, "prompt": "x" * 600}, "context_length_exceeded", "prompt"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 600}, "context_length_exceeded", "prompt"),
        ({"model": MODEL, "prompt": "hi", "temperature": -0.5}, "invalid_request", "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, "invalid_request", "top_p"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "invalid_request", "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "n": 0}, "invalid_request", "n"),
        ({"model": MODEL, "prompt": "hi", "n": 65}, "invalid_request", "n"),
        ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, "invalid_request", None),
        ({"model": MODEL, "prompt": [70000]}, "invalid_request", "prompt"),
        ({"model": MODEL}, "invalid_request", None),
        ({"model": MODEL, "messages": []}, "invalid_request", None),
        (
            {"model": MODEL, "prompt": "hi", "logit_bias": {"70000": 5}},
            "invalid_request",
            "logit_bias",
        ),
        (
            {"model": MODEL, "prompt": "hi", "presence_penalty": 3},
            "invalid_request",
            "presence_penalty",
        ),
        ({"model": MODEL, "prompt": "hi", "best_of": 2}, "unsupported_parameter", "best_of"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{}]},
            "unsupported_parameter",
            "tools",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "audio": {}},
            "unsupported_parameter",
            "audio",
        ),
        (
            {"model": MODEL, "prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}},
            "kv_role_mismatch",
            "kv_transfer_params",
        ),
    ],
)
def test_bad_input_is_a_400_with_the_common_openai_error_body(
    engine_server: Service, body: dict, code: str, param: str | None
) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(engine_server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, param)


def test_malformed_json_is_a_400(engine_server: Service, client: openai.OpenAI) -> None:
    r = httpx.post(
        engine_server.url + "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)


def test_disconnect_mid_stream_aborts_and_frees_blocks(engine_server: Service) -> None:
    wait_blocks_free(engine_server)
    aborted0 = engine_server.metric("dsv4_requests_aborted_total")
    body = {
        "model": MODEL,
        "prompt": "long " * 20,
        "max_tokens": 400,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    for _ in range(3):
        with httpx.stream("POST", engine_server.url + "/v1/completions", json=body) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i >= 3:
                    break  # closing the response drops the connection
    # non-streaming client that gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            engine_server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.0
        )
    wait_blocks_free(engine_server, timeout_s=20)
    assert engine_server.metric("dsv4_requests_aborted_total") >= aborted0 + 4


def test_metrics_use_vllm_names(engine_server: Service) -> None:
    text = httpx.get(engine_server.url + "/metrics").text
    for name in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
    ):
        assert name in text, name
    assert engine_server.metric("vllm:prefix_cache_hits_total") > 0  # the repeated prompts
    assert engine_server.metric("vllm:spec_decode_num_draft_tokens_total") > 0
