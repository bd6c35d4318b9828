"""Tiny and small model presets shipped in the repo: a config and a byte-level tokenizer.

``write_preset(name, dir)`` lays out a checkpoint directory (``config.json``,
``tokenizer.json``, ``tokenizer_config.json`` with a chat template) that every part of the
stack loads like a real checkpoint, with ``load_format=dummy`` weights.
"""

from dsv4_serving.presets.configs import PRESETS, preset_config
from dsv4_serving.presets.tokenizer import build_tokenizer, write_preset

__all__ = ["PRESETS", "build_tokenizer", "preset_config", "write_preset"]
