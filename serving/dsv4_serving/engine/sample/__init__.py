"""Sampling: the per-request parameters and the sampler that draws and verifies tokens."""
