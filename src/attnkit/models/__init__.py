"""Real models built only from attnkit parts."""

from attnkit.models.minilm import MiniLM
from attnkit.models.translator import DateTranslator

__all__ = ["DateTranslator", "MiniLM"]
