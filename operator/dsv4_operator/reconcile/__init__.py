"""Pure reconcile: a DeepSeekV4Deployment plus observed cluster facts -> the desired children.

Nothing here talks to a cluster; ``dsv4_operator.controller`` observes, applies the result and
writes the status.
"""

from dsv4_operator.reconcile.desired import Facts, desired_children
from dsv4_operator.reconcile.errors import ReconcileError

__all__ = ["Facts", "ReconcileError", "desired_children"]
