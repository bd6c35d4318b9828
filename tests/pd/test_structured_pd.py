"""Structured outputs through the gateway's PD path (real prefill and decode engines, their KV
sidecars, the gateway): the decode samples the first token the client sees and applies the
grammar from there, so the JSON validates and equals one engine's greedy answer; a bad schema
is the prefill's 400, before any KV moves."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from dsv4_common.process import Service
from dsv4_serving.structured.schema_corpus import schemas
from tests.gateway.conftest import engine, gateway, pd_pair, running

CASES = [c for c in schemas() if c["name"] in ("nested", "defs_ref", "bounded_numbers", "tuple")]
# a random-weight model rambles: favour closers, '"' above the brackets a string may hold
BIAS = {str(ord('"')): 10.0, str(ord("}")): 5.0, str(ord("]")): 5.0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Service]]:
    """(one engine doing both, the gateway over a prefill and a decode)."""
    token = tmp_path_factory.mktemp("kv") / "kv-token"
    token.write_text(secrets.token_urlsafe(24))
    (ps, pe), (ds, de) = pd_pair("sp", "prefill", token), pd_pair("sd", "decode", token)
    with (
        running(engine("structured-reference"), ps, pe, ds, de) as (ref, *_),
        running(gateway("gateway-structured", "--prefill", pe.url, "--decode", de.url)) as (g,),
    ):
        yield ref, g


def _ask(url: str, case: dict[str, Any], stream: bool) -> str:
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)
    args: dict[str, Any] = {
        "model": "dsv4-tiny",
        "messages": [{"role": "user", "content": f"A {case['name']} in JSON."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": case["name"], "schema": case["schema"], "strict": True},
        },
        "temperature": 0,
        "max_tokens": 400,
        "logit_bias": BIAS,
        "extra_body": {"thinking": {"type": "disabled"}},
    }
    if not stream:
        return c.chat.completions.create(**args).choices[0].message.content or ""
    chunks = c.chat.completions.create(**args, stream=True)
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_pd_json_validates_and_equals_one_engine(
    stack: tuple[Service, Service], case: dict[str, Any]
) -> None:
    ref, g = stack
    want = _ask(ref.url, case, stream=False)
    jsonschema.validate(json.loads(want), case["schema"])
    assert _ask(g.url, case, stream=False) == want
    assert _ask(g.url, case, stream=True) == want


def test_pd_bad_schema_is_the_prefills_400(stack: tuple[Service, Service]) -> None:
    _, g = stack
    c = openai.OpenAI(base_url=f"{g.url}/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(
            model="dsv4-tiny",
            messages=[{"role": "user", "content": "hi"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
            },
        )
    body: Any = info.value.body
    assert body["param"] == "response_format.json_schema.schema"
    assert "no-such-type" in body["message"]
