"""Modules built on :mod:`attnkit.functional`."""

from attnkit.nn.attention import MultiHeadAttention
from attnkit.nn.cache import KVCache

__all__ = ["KVCache", "MultiHeadAttention"]
