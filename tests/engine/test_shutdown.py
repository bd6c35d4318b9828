"""Graceful shutdown of a real engine process: SIGTERM turns /ready to 503 at once (liveness
stays 200), refuses new requests with 503 + X-DSV4-Draining, lets a long stream (longer than
uvicorn's own 5 s grace) finish through the OpenAI SDK, and exits 0; past --shutdown-timeout
what is left ends with a clear error, still exit 0."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from dsv4_common.process import Service
from tests.engine.common import start_engine

ARGS = ["--model", "dsv4-tiny", "--served-model-name", "tiny", "--num-kv-blocks", "200"]
ARGS += ["--max-model-len", "2048", "--num-speculative-tokens", "0"]


def _engine(tmp_path: Path, timeout: str) -> Service:
    server = start_engine("drain", tmp_path, *ARGS, "--shutdown-timeout", timeout)
    return server.wait_ready(180)


def _tokens_per_s(client: openai.OpenAI) -> float:
    t = time.monotonic()
    client.completions.create(
        model="tiny", prompt="hi", max_tokens=32, extra_body={"ignore_eos": True}
    )
    return 32 / (time.monotonic() - t)


class _Stream(threading.Thread):
    """A streamed completion consumed in the background: tokens, finish reason, error."""

    def __init__(self, client: openai.OpenAI, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client, self.max_tokens = client, max_tokens
        self.chunks = 0
        self.finish: str | None = None
        self.error: Exception | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            stream = self.client.completions.create(
                model="tiny",
                prompt="a long story",
                max_tokens=self.max_tokens,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            for chunk in stream:
                self.chunks += len(getattr(chunk.choices[0], "token_ids", None) or [])
                self.started.set()
                self.finish = chunk.choices[0].finish_reason or self.finish
        except Exception as e:
            self.error = e
        finally:
            self.started.set()


def _streaming(server: Service, max_tokens: int) -> _Stream:
    """A long stream from ``server``, started and past its first token."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    stream = _Stream(client, max_tokens)
    stream.start()
    assert stream.started.wait(60)
    return stream


def _status(url: str) -> int:
    return httpx.get(url, timeout=5).status_code


def _wait_exit(server: Service, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while server.running() and time.monotonic() < deadline:
        time.sleep(0.1)
    return server.exit_code()


def _sigterm(server: Service, group: bool = False) -> None:
    assert server.pid is not None
    if group:  # the engine's session: its front end and every rank process
        os.killpg(server.pid, signal.SIGTERM)
    else:
        os.kill(server.pid, signal.SIGTERM)


@pytest.mark.parametrize("group", [False, True], ids=["leader", "process-group"])
def test_sigterm_lets_a_long_stream_finish(tmp_path: Path, group: bool) -> None:
    server = _engine(tmp_path, "60")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        assert _status(server.url + "/ready") == 200
        # a stream that needs ~10 s more after SIGTERM: uvicorn alone would cut it at 5 s
        rate = _tokens_per_s(client)
        stream = _Stream(client, max_tokens=min(1900, max(40, int(rate * 12))))
        stream.start()
        assert stream.started.wait(60)
        _sigterm(server, group)
        deadline = time.monotonic() + 2
        while _status(server.url + "/ready") != 503:
            assert time.monotonic() < deadline, "/ready still 200 after SIGTERM"
            time.sleep(0.05)
        assert _status(server.url + "/health") == 200  # alive while draining
        r = httpx.post(
            server.url + "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 2},
            timeout=10,
        )
        assert r.status_code == 503
        assert r.headers["x-dsv4-draining"] == "1"
        assert r.json()["error"]["code"] == "draining"
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert err.value.status_code == 503
        stream.join(120)
        assert stream.error is None, stream.error
        assert (stream.finish, stream.chunks) == ("length", stream.max_tokens)
        assert _wait_exit(server, 30) == 0, server.tail()
    finally:
        server.stop()


def test_past_the_shutdown_timeout_the_rest_ends_with_an_error(tmp_path: Path) -> None:
    server = _engine(tmp_path, "1")
    try:
        stream = _streaming(server, max_tokens=1900)
        t = time.monotonic()
        _sigterm(server)
        stream.join(30)
        assert not stream.is_alive()
        assert isinstance(stream.error, openai.APIError), stream.error
        assert "shut down" in str(stream.error)
        assert 0 < stream.chunks < 1900
        assert _wait_exit(server, 30) == 0, server.tail()
        assert time.monotonic() - t < 15
    finally:
        server.stop()


def test_a_core_dying_mid_stream_ends_the_stream_with_a_clear_error(tmp_path: Path) -> None:
    server = _engine(tmp_path, "30")
    try:
        stream = _streaming(server, max_tokens=1900)
        children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
        assert children, "the engine core process"
        for pid in children:
            os.kill(int(pid), signal.SIGKILL)
        stream.join(30)
        assert not stream.is_alive()
        # an error event from the engine, not a connection cut mid-response
        assert isinstance(stream.error, openai.APIError), stream.error
        assert not isinstance(stream.error, openai.APIConnectionError), stream.error
        assert "engine core" in str(stream.error)
        assert _wait_exit(server, 30) == 1  # a dead core ends the engine (non-zero)
    finally:
        server.stop()
