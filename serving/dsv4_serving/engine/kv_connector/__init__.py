"""The engine's side of prefill/decode disaggregation, split like vLLM's ``KVConnectorBase_V1``.

- scheduler side (``scheduler_side.py``, pure Python): which requests need remote KV and how
  many tokens it covers, parking them while it arrives, and what happens when a request
  finishes (a prefill for a remote decode exports its KV before its blocks are freed);
- worker side (``worker_side.py``): the bytes, through the local ``dsv4 kv-sidecar`` only:
  export a request's paged blocks and state slot into the sidecar's staging region; pull and
  import KV into the blocks and slot allocated for a decode request.

They talk through the small dataclasses of ``metadata.py``. ``compat.py`` is what both sides
must agree on (block size, MTP lookahead, architecture, dtype, the prompt), checked before any
pull; ``kv_layout.py`` maps the model's cache onto the sidecar's named buffers.
"""
