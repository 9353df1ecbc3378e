"""Attention backends: the model calls one through :class:`AttentionBackend`."""

from paged_backend.attention.backend import AttentionBackend, AttentionMetadata
from paged_backend.attention.selector import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
