"""The serving engine, laid out as vLLM v1's: ``engine/`` (front end and engine core process),
``core/`` (KV cache manager, block pool, prefix hashes; ``core/sched/`` the scheduler),
``worker/`` (model loading, runner, each rank's process), ``sample/``, ``dp/`` (data
parallelism), ``emulated/`` (the emulated mode), ``kv_connector/`` (PD disaggregation), and
``request.py``, ``config.py``.

Importing this package (or its pure-logic modules: ``core/``, ``sample/sampling_params``)
never loads torch.
"""
