"""Scheduling core: the KV cache manager, its block pool and prefix hashes (vLLM v1's ``core/``)."""
