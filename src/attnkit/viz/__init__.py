"""Pictures of attention. Figures need matplotlib: ``pip install attnkit[viz]``;
the HTML view needs nothing beyond the standard library."""

from attnkit.viz.grid import attention_grid
from attnkit.viz.heatmap import visualize_attention
from attnkit.viz.html import attention_html, save_html

__all__ = ["attention_grid", "attention_html", "save_html", "visualize_attention"]
