from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pd.sidecars import SidecarFactory


@pytest.fixture
def sidecars(tmp_path: Path) -> Iterator[SidecarFactory]:
    """Starts ``dsv4 kv-sidecar`` processes; kills them and unlinks their regions afterwards."""
    factory = SidecarFactory(tmp_path, uuid.uuid4().hex[:8])
    try:
        yield factory
    finally:
        factory.close()
