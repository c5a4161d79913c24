"""Seeing into attention: capture the weights of any model built from attnkit layers or run
through the transformers integration, exact statistics of the weights at any length, attribution
and interventions; every tool hooks the model's attention through :class:`Sites`."""

from attnkit.inspect.attribution import Relevance, rollout
from attnkit.inspect.capturing import Capture, capture
from attnkit.inspect.interventions import HeadEffects, Intervention, head_effects, intervene
from attnkit.inspect.kv import kv_scores
from attnkit.inspect.sites import Site, Sites
from attnkit.inspect.stats import AttentionStats, attention_stats

__all__ = [
    "AttentionStats",
    "Capture",
    "HeadEffects",
    "Intervention",
    "Relevance",
    "Site",
    "Sites",
    "attention_stats",
    "capture",
    "head_effects",
    "intervene",
    "kv_scores",
    "rollout",
]
