"""Real models built only from attnkit parts."""

from attnkit.models.minilm import MiniLM

__all__ = ["MiniLM"]
