"""Attention over image regions: each word's cross-attention over the patches of an image.

``region_figure`` draws one panel per word (the image, its attention as a heatmap on
top); ``region_html`` writes a self-contained page where hovering a word shows its
region. Both take ``attention: (words, patches)`` with patches on a ``(rows, cols)``
grid ordered column by column (top to bottom), as :class:`attnkit.models.DigitCaptioner`
gives them.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from attnkit._types import ArrayLike, PathLike
from attnkit._validate import AttnkitValueError
from attnkit.viz.heatmap import as_array, new_figure, save

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _check(image, words, attention, grid):
    image, attention = as_array(image), as_array(attention)
    rows, cols = grid
    if image.ndim != 2 or attention.ndim != 2:
        raise AttnkitValueError(
            f"image must be 2-D and attention (words, patches), but got {image.shape} and {attention.shape}."
        )
    if attention.shape != (len(words), rows * cols):
        raise AttnkitValueError(
            f"attention must be (words, patches) = ({len(words)}, {rows * cols}) for {len(words)} words on a "
            f"{rows} x {cols} grid, but got {attention.shape}."
        )
    if image.shape[0] % rows or image.shape[1] % cols:
        raise AttnkitValueError(f"an image of shape {image.shape} does not split into a {rows} x {cols} patch grid.")
    return image, attention


def patch_map(attention_row: np.ndarray, grid: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    """One word's attention ``(patches,)`` as a pixel map of ``shape`` (patches column by column)."""
    import numpy as np

    rows, cols = grid
    per_patch = np.asarray(attention_row).reshape(cols, rows).T  # (rows, cols)
    return np.kron(per_patch, np.ones((shape[0] // rows, shape[1] // cols)))


def region_figure(
    image: ArrayLike,
    words: Sequence[str],
    attention: ArrayLike,
    grid: tuple[int, int],
    save_path: PathLike | None = None,
    *,
    title: str | None = None,
) -> Figure:
    """One panel per word: the image in grey (smoothed, so that 8-pixel digits read as strokes),
    the word's attention as a light orange tint (the digit stays readable under it) and a box
    around the patches whose weight is at least half the peak. Returns the Figure."""
    import numpy as np

    Figure = new_figure()
    image, attention = _check(image, words, attention, grid)
    n = len(words)
    fig = Figure(figsize=(max(3.0, image.shape[1] / 8 * 1.1 + 1), 1.0 + 1.35 * max(n, 1)), layout="constrained")
    axes = fig.subplots(max(n, 1), 1, squeeze=False)[:, 0]
    for ax, word, row in zip(axes, words, attention):
        ax.imshow(image, cmap="gray_r", vmin=0, vmax=16, interpolation="bicubic")
        heat = patch_map(row, grid, (image.shape[0], image.shape[1]))
        overlay = np.zeros((*heat.shape, 4))
        top = max(float(heat.max()), 1e-9)
        overlay[..., :3] = (1.0, 0.35, 0.0)  # orange, light enough to keep the strokes visible
        overlay[..., 3] = 0.35 * heat / top
        ax.imshow(overlay)
        if float(heat.max()) > float(heat.min()):  # the outline of where the word looked
            ax.add_collection(_outline(heat >= 0.5 * top))
        ax.set_xlim(-0.5, image.shape[1] - 0.5)
        ax.set_ylim(image.shape[0] - 0.5, -0.5)
        ax.set_xticks([]), ax.set_yticks([])
        ax.set_title(word, loc="left", fontsize=12)
    if title:
        fig.suptitle(title)
    save(fig, save_path)
    return fig


def _outline(inside: np.ndarray):
    """The border of the pixels marked ``inside`` (rows, cols), along pixel edges: a closed box
    around a patch (a contour through pixel centres would cut it open at the image's edge)."""
    from matplotlib.collections import LineCollection

    rows, cols = inside.shape
    padded = np.pad(inside, 1)
    segments = []
    for r, c in zip(*np.nonzero(inside)):
        top, left, bottom, right = r - 0.5, c - 0.5, r + 0.5, c + 0.5
        if not padded[r, c + 1]:  # the pixel above is outside
            segments.append([(left, top), (right, top)])
        if not padded[r + 2, c + 1]:
            segments.append([(left, bottom), (right, bottom)])
        if not padded[r + 1, c]:
            segments.append([(left, top), (left, bottom)])
        if not padded[r + 1, c + 2]:
            segments.append([(right, top), (right, bottom)])
    return LineCollection(segments, colors="#e04a00", linewidths=2.5, capstyle="projecting")


def region_html(
    image: ArrayLike,
    words: Sequence[str],
    attention: ArrayLike,
    grid: tuple[int, int],
    *,
    layers: ArrayLike | None = None,
    title: str = "attention over regions",
) -> str:
    """A page: the image, the words; hovering (or clicking) a word shows its attention over the image.

    ``attention`` is ``(words, patches)`` or, to choose among them on the page,
    ``(layers, heads, words, patches)`` (the page offers each layer's heads and their mean).
    """
    from attnkit.viz.html import asset, fill, printable, script_json

    full = as_array(attention)
    if full.ndim == 2:
        full = full[None, None]
    if full.ndim != 4:
        raise AttnkitValueError(
            f"attention must be (words, patches) or (layers, heads, words, patches), but got {full.shape}."
        )
    image, _ = _check(image, words, full[0, 0], grid)
    names = [str(n) for n in layers] if layers is not None else [f"layer {i}" for i in range(full.shape[0])]
    data = {
        "title": str(title),
        "words": [str(w) for w in words],
        "image": [[round(float(v), 2) for v in row] for row in image],
        "grid": list(grid),
        "layerNames": names,
        "attention": [[[[round(float(v), 4) for v in w] for w in h] for h in layer] for layer in full],
    }
    return fill(asset("regions.html"), title=html.escape(printable(str(title))), data=script_json(data))


def save_region_html(
    path: PathLike, image: ArrayLike, words: Sequence[str], attention: ArrayLike, grid: tuple[int, int], **kwargs: Any
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(region_html(image, words, attention, grid, **kwargs), encoding="utf-8")
    return path


__all__ = ["patch_map", "region_figure", "region_html", "save_region_html"]
_ = torch  # tensors are accepted through as_array
