"""Paged attention: the layer models call, the backend interface, and its implementations (cpu:
C++ kernels; torch: the plain-torch reference and oracle)."""

from pagedserve.layers.attention.backend import AttentionBackend, AttentionMetadata, BatchLayout, PrefillChunk
from pagedserve.layers.attention.layer import Attention
from pagedserve.layers.attention.selector import select_attention_backend

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "BatchLayout", "PrefillChunk", "select_attention_backend"]
