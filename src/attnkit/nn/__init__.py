"""Modules built on :mod:`attnkit.functional`."""

from attnkit.nn.attention import MultiHeadAttention
from attnkit.nn.cache import KVCache
from attnkit.nn.rotary import RotaryEmbedding

__all__ = ["KVCache", "MultiHeadAttention", "RotaryEmbedding"]
