"""Attention: the layers, their per-step plans, the KV cache layouts and the backends.

- ``metadata.py``: one step's flat batch (``AttentionMetadata``), built by the engine;
- ``mla.py``, ``v4.py``: the attention layers (DeepSeek V3's MLA, V4's sparse compressed);
- ``mla_step.py``, ``v4_step.py``, ``v4_prefill_plan.py``: per-step plans, built once per
  step and shared by every layer;
- ``kv_cache/``: the tensors the layers read and write (the engine owns which blocks and
  slots a sequence holds);
- ``backends/``: one implementation per device and family (cache layout, plan, kernels);
- ``selector.py``: builds the backend the platform's decision names.
"""
