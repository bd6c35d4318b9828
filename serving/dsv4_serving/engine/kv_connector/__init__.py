"""The engine's side of prefill/decode disaggregation, split like vLLM's ``KVConnectorBase_V1``.

- scheduler side (``scheduler_side.py``, pure Python, no I/O, runs inside ``Scheduler``): which
  requests take their prompt's KV from elsewhere and how much; decode requests get blocks for
  the whole prompt (+ MTP lookahead) and a state slot, then wait parked while the KV arrives;
  a finished prefill for a remote decode keeps its blocks until its KV was exported.
- worker side (``worker_side.py``): the bytes, through the local ``dsv4 kv-sidecar`` only:
  export a request's paged blocks and state slot into the sidecar's staging region; pull and
  import KV into the blocks and slot allocated for a decode request. It sees the model's cache
  tensors; pulls are imported between forwards, exports copy the blocks of finished prefills on
  the connector's thread while the next forwards run (those blocks stay allocated until then).

``exporter.py`` runs the exports on their thread. ``base.py`` holds the two interfaces,
``metadata.py`` the data they exchange each step (the order of the calls is
``EngineCore.step``'s). ``compat.py`` is what both engines must agree on (block size, MTP
lookahead, architecture, dtype, the prompt), checked before any pull; ``kv_layout.py`` maps the
model's cache onto the sidecar's named buffers.
"""
