"""Heatmaps of attention weights, written to a file without opening a window."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from attnkit._types import ArrayLike, PathLike
from attnkit._validate import AttnkitTypeError, AttnkitValueError, MissingExtraError

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def as_array(weights: ArrayLike) -> np.ndarray:
    """A float32 numpy array from a tensor or array."""
    import numpy as np
    import torch

    if isinstance(weights, torch.Tensor):
        return weights.detach().to("cpu", torch.float32).numpy()
    if isinstance(weights, np.ndarray):
        return weights.astype(np.float32)
    raise AttnkitTypeError(f"weights must be a torch.Tensor or numpy array, but got {type(weights).__name__}.")


def new_figure() -> type[Figure]:
    """matplotlib's ``Figure`` (figures are drawn without pyplot: no window, no backend change)."""
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        raise MissingExtraError(
            "attnkit's figures need matplotlib, which is not installed: pip install 'attnkit[viz]'"
        ) from None
    return Figure


def save(fig: Figure, save_path: PathLike | None, tight: bool = False) -> None:
    """Write ``fig`` to ``save_path`` (format from the extension), creating the folder; ``tight``:
    cropped to what is drawn (no empty frame around a strip of few rows)."""
    if save_path is None:
        return
    path = Path(save_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.savefig(path, dpi=150, bbox_inches="tight", pad_inches=0.15)
    else:
        fig.savefig(path, dpi=150)


def _index(value, name: str, size: int, shape) -> int:
    import operator

    try:
        value = operator.index(value)
    except TypeError:
        raise AttnkitTypeError(f"{name} must be an int, but got {type(value).__name__}.") from None
    if not -size <= value < size:
        raise AttnkitValueError(
            f"{name}={value} is out of range for weights of shape {shape}, which hold {size} "
            f"along that axis: use 0 to {size - 1}."
        )
    return value % size


def _as_matrix(weights, sample=0, head=0):
    """The ``(Lq, Lk)`` matrix to draw and the index it came from (``()`` for 2-D input).

    ``(Lq, Lk)`` is drawn as it is, ``(B, Lq, Lk)`` as ``weights[sample]`` and
    ``(B, H, Lq, Lk)`` as ``weights[sample, head]``.
    """
    weights = as_array(weights)
    shape = tuple(weights.shape)
    if weights.ndim == 2:
        return weights, ()
    if weights.ndim == 3:
        sample = _index(sample, "sample", shape[0], shape)
        return weights[sample], (sample,)
    if weights.ndim == 4:
        sample = _index(sample, "sample", shape[0], shape)
        head = _index(head, "head", shape[1], shape)
        return weights[sample, head], (sample, head)
    raise AttnkitValueError(
        f"weights must be (Lq, Lk), (B, Lq, Lk) or (B, H, Lq, Lk), but got shape {shape}. "
        "Pick one sequence and head first, e.g. weights[0, head]."
    )


def visualize_attention(
    weights: ArrayLike,
    tokens: Sequence[str],
    save_path: PathLike | None = "attention.png",
    *,
    key_tokens: Sequence[str] | None = None,
    title: str | None = None,
    cmap: str = "viridis",
    annotate: bool | None = None,
    xlabel: str = "key",
    ylabel: str = "query",
    sample: int = 0,
    head: int = 0,
) -> Figure:
    """Draw one head's attention weights as a heatmap with token labels and a colour bar.

    Args:
        weights: a tensor or array: ``(Lq, Lk)`` is drawn as it is; of
            ``(B, Lq, Lk)`` the matrix ``weights[sample]`` is drawn (the tutorial's
            ``attention_weights[0]``), of ``(B, H, Lq, Lk)`` ``weights[sample, head]``.
            The default title names the matrix drawn.
        tokens: the ``Lq`` query tokens; also the key tokens unless ``key_tokens``
            is given (cross-attention).
        save_path: file to write; the format follows the extension (``.png``,
            ``.svg``, ``.pdf``). None writes nothing.
        annotate: print each weight in its cell (default: when both sides have at
            most 16 tokens).

    Returns:
        The ``matplotlib.figure.Figure``. No window is opened, so it works on
        machines without a display.
    """
    Figure = new_figure()
    from attnkit.viz._fonts import drawable, font_families

    shape = tuple(getattr(weights, "shape", ()))
    matrix, picked = _as_matrix(weights, sample, head)
    if isinstance(tokens, str) or not hasattr(tokens, "__len__"):
        raise AttnkitTypeError(f"tokens must be a list of strings, one per position, but got {type(tokens).__name__}.")
    tokens = [str(t) for t in tokens]
    key_tokens = tokens if key_tokens is None else [str(t) for t in key_tokens]
    if (len(tokens), len(key_tokens)) != matrix.shape:
        what = f"weights{list(picked)} of weights {shape}" if picked else f"weights of shape {shape}"
        raise AttnkitValueError(
            f"{what} is a {matrix.shape[0]} x {matrix.shape[1]} matrix: it needs {matrix.shape[0]} "
            f"query tokens and {matrix.shape[1]} key tokens, but got {len(tokens)} and {len(key_tokens)}. "
            "Give one token per position (or key_tokens= for cross-attention)."
        )
    if title is None and picked:
        title = f"sample {picked[0]}, head {picked[1]}" if len(picked) == 2 else f"weights[{picked[0]}]"
    lq, lk = matrix.shape
    if annotate is None:
        annotate = lq <= 16 and lk <= 16
    rotated = lk > 6
    # room for the labels: rotated key labels take about 0.065 in per character downwards, row
    # labels 0.075 in per character sideways (10 pt text), so long titles are never cut
    longest_key = max((len(t) for t in key_tokens), default=1)
    longest_row = max((len(t) for t in tokens), default=1)
    below = 0.065 * longest_key + 0.7 if rotated else 0.6
    size = (max(4.0, 0.55 * lk + 2.0 + 0.075 * longest_row), max(3.5, 0.5 * lq + 1.2 + below))
    if title:
        import textwrap

        title = "\n".join(textwrap.wrap(title, max(30, int(size[0] * 11))))
        size = (size[0], size[1] + 0.2 * title.count("\n"))
    fig = Figure(figsize=size, layout="constrained")
    ax = fig.add_subplot()
    families = list(font_families())
    tokens, key_tokens = [drawable(t) for t in tokens], [drawable(t) for t in key_tokens]
    title = drawable(title) if title else title
    image = ax.imshow(matrix, cmap=cmap, vmin=0.0, vmax=max(float(matrix.max(initial=0.0)), 1e-9))
    ax.set_xticks(
        range(lk),
        key_tokens,
        rotation=45 if rotated else 0,
        ha="right" if rotated else "center",
        rotation_mode="anchor",
        fontfamily=families,
    )
    ax.set_yticks(range(lq), tokens, fontfamily=families)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontfamily=families)
    if annotate:
        threshold = 0.5 * float(matrix.max(initial=0.0))
        for i in range(lq):
            for j in range(lk):
                value = float(matrix[i, j])
                ax.text(
                    j,
                    i,
                    f"{value:.2f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="black" if value > threshold else "white",
                )
    # the colour bar as tall as the cells (a wide strip of few rows gets a short bar, not a tall frame)
    fig.colorbar(image, ax=ax, label="attention weight", shrink=min(1.0, max(0.35, 2.5 * lq / lk)), aspect=12)
    save(fig, save_path, tight=True)
    return fig


#: Token labels along each axis of :func:`heads_figure`'s panels at most: a longer input labels every
#: n-th token (256 tokens at 12 pt would make a panel 58 inches wide and the PNG 26,000 pixels).
HEADS_LABELS = 64


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def heads_figure(
    weights: ArrayLike, picks: Sequence[tuple[int, int, str]], tokens: Sequence[str], save_path: PathLike | None
) -> Figure:
    """A few heads of ``weights: (layers, heads, L, L)`` side by side, large enough to read their token
    labels: ``picks`` are ``(layer, head, what it does)``. The figure a page shows first, before the
    grid of every head."""
    Figure = new_figure()
    from attnkit.viz._fonts import drawable, font_families

    families = list(font_families())
    labels = [drawable(str(t)) for t in tokens]
    matrices = [as_array(weights)[layer, head] for layer, head, _ in picks]
    length = len(labels)
    step = -(-length // HEADS_LABELS)  # a long input labels every step-th token (the panel stays a page's size)
    ticks = range(0, length, step)
    side = max(3.0, 0.22 * len(ticks) + 1.6)  # inches a panel; its labels at 12 pt read at a page's width
    fig = Figure(figsize=(side * len(picks) + 0.8, side + 1.1), layout="constrained")
    axes = fig.subplots(1, len(picks), squeeze=False)[0]
    every = "" if step == 1 else f" (every {_ordinal(step)} labelled)"
    for ax, matrix, (layer, head, what) in zip(axes, matrices, picks):
        image = ax.imshow(matrix, cmap="viridis", vmin=0.0, vmax=max(float(matrix.max(initial=0.0)), 1e-9))
        ax.set_xticks(ticks, [labels[i] for i in ticks], rotation=60, ha="right", rotation_mode="anchor",
                      fontsize=12, fontfamily=families)  # fmt: skip
        ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=12, fontfamily=families)
        ax.set_title(f"layer {layer}, head {head}:\n{what}", fontsize=13)
        ax.set_xlabel(f"key{every}", fontsize=12)
        ax.set_ylabel(f"query{every}", fontsize=12)
        fig.colorbar(image, ax=ax, shrink=0.7, aspect=15).ax.tick_params(labelsize=10)
    save(fig, save_path)
    return fig
