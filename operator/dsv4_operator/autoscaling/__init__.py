"""The autoscaler's pure core: what to scale to, from what was observed (issue 14).

``decide(observations, state, policy, now)`` is a pure function of its inputs, so a trace of
observations replays to the same decisions; the operator's loop feeds it and applies the result.
"""
