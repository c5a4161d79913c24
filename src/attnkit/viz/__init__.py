"""Pictures of attention: figures (PNG, SVG, PDF) and self-contained HTML views.

The HTML views need nothing beyond attnkit's core. Figures need the ``viz`` extra
(``pip install 'attnkit[viz]'``: matplotlib, and a CJK font for token labels); without it
they raise an error that says so. :func:`widget` (a live view in a notebook) needs the
``widget`` extra (``pip install 'attnkit[widget]'``: anywidget).
"""

from attnkit.viz.grid import attention_grid
from attnkit.viz.heatmap import visualize_attention
from attnkit.viz.html import attention_html, save_html
from attnkit.viz.shaded import relevance
from attnkit.viz.widgets import widget

__all__ = ["attention_grid", "attention_html", "relevance", "save_html", "visualize_attention", "widget"]
