"""Pictures of attention. Needs matplotlib: ``pip install attnkit[viz]``."""

from attnkit.viz.heatmap import visualize_attention

__all__ = ["visualize_attention"]
