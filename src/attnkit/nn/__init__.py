"""Modules built on :mod:`attnkit.functional`."""

from attnkit.nn.attention import MultiHeadAttention
from attnkit.nn.cache import KVCache, layer_budgets
from attnkit.nn.rotary import RotaryEmbedding

__all__ = ["KVCache", "MultiHeadAttention", "RotaryEmbedding", "layer_budgets"]
