"""The emulated engine (``--emulate-step-time``): a runner that sleeps a modelled step time."""
