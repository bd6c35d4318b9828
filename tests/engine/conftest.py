"""A real ``dsv4 engine`` process on 127.0.0.1 per module, stopped by the fixture."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dsv4_common.process import Service
from tests.engine.common import start_engine


@pytest.fixture(scope="module")
def engine_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    args = getattr(request.module, "ENGINE_ARGS", ["--model", "dsv4-tiny"])
    server = start_engine("api", tmp_path_factory.mktemp("engine"), *args)
    try:
        server.wait_ready(180)
        yield server
    finally:
        server.stop()
