"""Every head of every layer at a glance: a grid of small heatmaps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from attnkit._types import ArrayLike, PathLike
from attnkit._validate import AttnkitValueError
from attnkit.viz.heatmap import as_array, new_figure, save

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def attention_grid(
    weights: ArrayLike,
    save_path: PathLike | None = "attention_grid.png",
    *,
    tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    title: str | None = None,
    cmap: str = "viridis",
) -> Figure:
    """Draw ``weights: (layers, heads, Lq, Lk)`` as a layers x heads grid of heatmaps.

    ``tokens`` (optional) label the first column's rows, and ``key_tokens`` (default:
    ``tokens``, for self-attention) the last row's columns, when each side has at most 24.
    Returns the figure; writes ``save_path`` (PNG, SVG or PDF by extension) unless it is None.
    """
    array = as_array(weights)
    if array.ndim != 4:
        raise AttnkitValueError(
            f"weights must have shape (layers, heads, Lq, Lk), but got {array.shape}. "
            "Use cap.stack() to stack captured weights."
        )
    layers, heads, lq, lk = array.shape
    Figure = new_figure()
    from attnkit.viz._fonts import drawable, font_families

    families = list(font_families())
    key_tokens = tokens if key_tokens is None else key_tokens
    label = tokens is not None and key_tokens is not None and len(tokens) == lq <= 24 and len(key_tokens) == lk <= 24
    cell = max(1.15, 0.085 * max(lq, lk)) if label else 1.15  # room for 6-point labels
    tall = min(1.0, lq / lk)  # panels keep square cells: a wide matrix makes short panels
    fig = Figure(figsize=(0.9 + cell * heads, 0.9 + cell * tall * layers + (0.5 if label else 0)), layout="constrained")
    axes = fig.subplots(layers, heads, squeeze=False)
    for layer in range(layers):
        for head in range(heads):
            ax = axes[layer][head]
            ax.imshow(
                array[layer, head], cmap=cmap, vmin=0.0, vmax=max(float(array[layer, head].max(initial=0.0)), 1e-9)
            )
            ax.set_xticks([])
            ax.set_yticks([])
            if layer == 0:
                ax.set_title(f"head {head}", fontsize=8)
            if head == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=8)
    if label and tokens is not None and key_tokens is not None:
        for head in range(heads):
            ax = axes[-1][head]
            ax.set_xticks(
                range(lk), [drawable(str(t)) for t in key_tokens], rotation=90, fontsize=6, fontfamily=families
            )
        for layer in range(layers):
            axes[layer][0].set_yticks(range(lq), [drawable(str(t)) for t in tokens], fontsize=6, fontfamily=families)
    if title:
        fig.suptitle(drawable(title), fontfamily=families)
    save(fig, save_path)
    return fig
