"""Modules built on :mod:`attnkit.functional`."""

from attnkit.nn.attention import MultiHeadAttention

__all__ = ["MultiHeadAttention"]
