"""The KV cache the model reads and writes, and the metadata of one flat batch.

The engine owns allocation (which block ids and state slots a sequence holds); the model only
reads and writes the tensors described here, addressed by the metadata of each step.
"""

from dsv4_serving.cache.metadata import AttentionMetadata, SeqChunk
from dsv4_serving.cache.paged import gather_entries, scatter_entries

__all__ = ["AttentionMetadata", "SeqChunk", "gather_entries", "scatter_entries"]
