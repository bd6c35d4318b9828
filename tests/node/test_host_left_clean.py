"""After every other node test (``after_the_tier(1)``, conftest.py): stop the cluster and its
real node, then check that no process, link, iptables rule, mount, cgroup or fixed directory of
it is left."""

from __future__ import annotations

import pytest

from tests.node.conftest import RealClusterHandle


@pytest.mark.after_the_tier(1)
def test_nothing_of_the_tier_is_left_on_the_host(real_handle: RealClusterHandle) -> None:
    real_handle.get()  # the tier ran (or this test alone brings the node up and down)
    left = real_handle.close()
    assert left == {}, f"host state left behind: {left}"
