"""The serving engine: scheduler, paged KV cache manager, model runner, engine core.

Importing this package (or its pure-logic modules: ``prefix_hash``, ``block_pool``,
``kv_cache_manager``, ``scheduler``, ``sampling_params``) never loads torch.
"""
