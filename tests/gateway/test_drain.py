"""Rolling restarts through the gateway, real processes: an engine sent SIGTERM finishes its
stream, the gateway sends new requests elsewhere (its 503 + X-DSV4-Draining is retried, not a
failure), and a gateway sent SIGTERM fails /ready at once, finishes its relays and exits 0."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai

from dsv4_common.process import Service
from tests.gateway.conftest import engine, gateway, running


def _long_stream(url: str, max_tokens: int, out: dict[str, object]) -> threading.Thread:
    def run() -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        try:
            n, finish = 0, None
            for chunk in client.completions.create(
                model="dsv4-tiny",
                prompt="once upon a time",
                max_tokens=max_tokens,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            ):
                n += len(getattr(chunk.choices[0], "token_ids", None) or [])
                out["started"] = True
                finish = chunk.choices[0].finish_reason or finish
            out["result"] = (n, finish)
        except Exception as e:
            out["result"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _running(e: Service) -> float:
    return e.metric("vllm:num_requests_running")


def _wait(cond: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def _exit_code(s: Service, timeout_s: float) -> int | None:
    _wait(lambda: not s.running(), timeout_s)
    return s.exit_code()


def test_engine_and_gateway_drain_on_sigterm() -> None:
    a = engine("drain-a", "--shutdown-timeout", "60")
    b = engine("drain-b", "--shutdown-timeout", "60")
    with running(a, b) as _:
        g = gateway("drain-gw", "--engine", a.url, "--engine", b.url, "--shutdown-timeout", "60")
        g.argv += ["--policy", "round_robin", "--retries", "1"]
        with running(g):
            out: dict[str, object] = {}
            stream = _long_stream(g.url, 150, out)
            _wait(lambda: out.get("started"), 60)
            busy, other = (a, b) if _running(a) else (b, a)
            assert busy.pid is not None
            os.kill(busy.pid, signal.SIGTERM)
            _wait(lambda: httpx.get(busy.url + "/ready").status_code == 503, 5)
            # every new request succeeds: those sent to the draining engine are retried
            client = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
            for _ in range(4):
                r = client.completions.create(model="dsv4-tiny", prompt="hi", max_tokens=2)
                assert r.choices[0].text is not None
            insts = {i["url"]: i for i in httpx.get(g.url + "/instances").json()}
            assert insts[busy.url]["draining"] and insts[busy.url]["failures"] == 0
            stream.join(120)
            assert out["result"] == (150, "length"), out["result"]
            assert _exit_code(busy, 30) == 0, busy.tail()

            # the gateway itself: /ready fails at once, its relay finishes, exit 0
            out = {}
            stream = _long_stream(g.url, 100, out)
            _wait(lambda: out.get("started"), 60)
            assert g.pid is not None
            os.kill(g.pid, signal.SIGTERM)
            _wait(lambda: httpx.get(g.url + "/ready").status_code == 503, 5)
            stream.join(120)
            assert out["result"] == (100, "length"), out["result"]
            assert _exit_code(g, 30) == 0, g.tail()
            assert other.running()
