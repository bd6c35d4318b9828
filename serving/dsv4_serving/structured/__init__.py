"""Structured outputs, engine side: grammar specs from requests, compiled grammars, token masks.

Pure but for ``bitmask.py`` (torch, where a mask meets the logits) and the grammar library
behind ``llguidance_backend.py``.
"""
