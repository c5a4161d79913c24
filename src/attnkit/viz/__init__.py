"""Pictures of attention: figures (matplotlib) and self-contained HTML views. Needs the
``viz`` extra: ``pip install 'attnkit[viz]'`` (matplotlib, and a CJK font for token labels)."""

from attnkit.errors import check_extra

check_extra("viz", "attnkit.viz")

from attnkit.viz.grid import attention_grid
from attnkit.viz.heatmap import visualize_attention
from attnkit.viz.html import attention_html, save_html

__all__ = ["attention_grid", "attention_html", "save_html", "visualize_attention"]
