"""``python -m dsv4_serving.kernels.build`` (``make install``): every kernel, shared out over
child processes, and the names of those that did not build."""

from __future__ import annotations

import pytest

from dsv4_serving.kernels.build import ALL, prebuild

pytestmark = pytest.mark.unit


def test_kernels_that_cannot_build_are_named_each_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # DSV4_KERNELS=off makes every build refuse, without a compiler run
    monkeypatch.setenv("DSV4_KERNELS", "off")
    failed = prebuild(ALL, jobs=2)
    assert sorted(failed) == sorted(f"{n}:{v}" if v else n for n, v in ALL)


def test_a_child_that_dies_counts_its_whole_share_as_not_built() -> None:
    # an unknown variant is a KeyError in the child, not a KernelUnavailable: the child exits 1
    assert prebuild((("mhc", "no-such-variant"),), jobs=4) == ["mhc:no-such-variant"]
