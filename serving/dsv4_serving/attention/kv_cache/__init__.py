"""The KV cache layouts the attention layers read and write: MLA's paged latent rows
(``mla.py``), V4's hybrid rings and compressed entries (``v4.py``), and paged row addressing
(``paged.py``). Each backend names its layout (``AttentionBackend.cache_class``).

The engine owns allocation (which block ids and state slots a sequence holds); the model only
reads and writes the tensors described here, addressed by the metadata of each step.
"""
