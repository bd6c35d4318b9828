"""Pure reconcile: a DeepSeekV4Deployment plus observed cluster facts -> the desired children.

Nothing here talks to a cluster; the kopf handlers in ``dsv4_operator.handlers`` apply the result.
"""

from dsv4_operator.reconcile.desired import Facts, desired_children

__all__ = ["Facts", "desired_children"]
