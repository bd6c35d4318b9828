"""The tier's last module (files run in name order): stop the cluster and its real node, then
check that no process, link, iptables rule, mount, cgroup or fixed directory of it is left."""

from __future__ import annotations

from tests.node.conftest import RealClusterHandle


def test_nothing_of_the_tier_is_left_on_the_host(real_handle: RealClusterHandle) -> None:
    real_handle.get()  # the tier ran (or this test alone brings the node up and down)
    left = real_handle.close()
    assert left == {}, f"host state left behind: {left}"
