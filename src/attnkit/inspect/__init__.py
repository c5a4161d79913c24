"""Seeing into attention: capture the weights of any model built from attnkit layers, and
exact statistics of the weights at any length."""

from attnkit.inspect.capture import Capture, capture
from attnkit.inspect.intervene import HeadEffects, Intervention, head_effects, intervene
from attnkit.inspect.kv import kv_scores
from attnkit.inspect.rollout import rollout
from attnkit.inspect.stats import AttentionStats, attention_stats

__all__ = [
    "AttentionStats",
    "Capture",
    "HeadEffects",
    "Intervention",
    "attention_stats",
    "capture",
    "head_effects",
    "intervene",
    "kv_scores",
    "rollout",
]
