"""Attention over long inputs: statistics per layer and head, key mass over the whole text,
and the full weights of chosen rows, as one self-contained HTML page and PNGs.

Made from :func:`attnkit.capture` in ``mode="stats"`` with ``rows=``: nothing here holds
an ``L x L`` matrix. Values over the keys (mass received, a row's weights) are stored
as one byte each on a log scale (six decades below each head's largest value), so
32k tokens x 6 layers x 12 heads with one chosen row take about 6 MB.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from attnkit._types import PathLike
from attnkit._validate import AttnkitValueError
from attnkit.viz.heatmap import as_array, new_figure
from attnkit.viz.html import asset, fill, font_face, printable, script_json


@runtime_checkable
class StatsView(Protocol):
    """What the views read of one layer's statistics (an :class:`attnkit.inspect.AttentionStats`
    has it): ``entropy (B, H, Lq)`` in nats, ``received (B, H, Lk)``, and ``head_summary()`` (a value
    per head of entropy, sink mass, mean distance and largest weight). viz reads it by its shape and
    imports nothing of inspect."""

    entropy: torch.Tensor
    received: torch.Tensor

    def head_summary(self) -> dict[str, torch.Tensor]: ...


#: The largest page :func:`long_html` writes (bytes).
MAX_PAGE_BYTES = 10 * 2**20
#: Decades below each head's maximum that the byte scale keeps.
DECADES = 6.0
#: Entropy is stored in nats (AttentionStats) and shown in bits: multiply by this.
BITS = 1.0 / math.log(2.0)


def log_bytes(values: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """``(rows, n)`` non-negative values as uint8 on a log scale; returns the bytes and each
    row's ``log10`` maximum (0 stays 0; other values map to 1..255)."""
    values = np.nan_to_num(np.clip(values.astype(np.float64), 0.0, None))
    top = values.max(axis=1, initial=0.0)
    hi = np.log10(np.where(top > 0, top, 1.0))
    with np.errstate(divide="ignore"):
        logs = np.log10(values)
    scaled = 1 + np.rint((logs - (hi - DECADES)[:, None]) / DECADES * 254)
    out = np.where(values > 0, np.clip(scaled, 1, 255), 0).astype(np.uint8)
    return out, [float(x) for x in hi]


def bin_profile(values: np.ndarray, bins: int, how: str = "max") -> tuple[np.ndarray, int]:
    """``values (n,)`` in at most ``bins`` points: runs of ``ceil(n / bins)`` tokens, each drawn as its
    largest value (``how="max"``) or its mean (``"mean"``); returns the points and the run length."""
    n = values.shape[0]
    size = max(1, math.ceil(n / bins))
    padded = np.full(math.ceil(n / size) * size, np.nan)
    padded[:n] = values
    parts = padded.reshape(-1, size)
    return (np.nanmax(parts, axis=1) if how == "max" else np.nanmean(parts, axis=1)), size


def long_data(
    stats: Sequence[StatsView],
    tokens: Sequence[str],
    rows: Sequence[int],
    row_weights: Sequence[torch.Tensor],
    *,
    names: Sequence[str] | None = None,
    title: str = "attention over a long input",
) -> dict:
    """The page's data. ``stats``: one :class:`~attnkit.inspect.AttentionStats` per layer (of one
    sequence: batch index 0 is used); ``rows``: the chosen query rows; ``row_weights``: one
    ``(B, H, len(rows), Lk)`` tensor per layer."""
    if not stats:
        raise AttnkitValueError("no layer was captured: there is nothing to draw.")
    layers = len(stats)
    heads, lq = stats[0].entropy.shape[-2:]
    lk = stats[0].received.shape[-1]
    tokens = [str(t) for t in tokens]
    if len(tokens) != lk:
        raise AttnkitValueError(f"the statistics cover {lk} keys but {len(tokens)} tokens were given.")
    summary = {  # entropy in bits, like every other view
        name: [[float(x) * (BITS if name == "entropy" else 1.0) for x in s.head_summary()[name]] for s in stats]
        for name in ("entropy", "sink_mass", "mean_distance", "max_weight")
    }
    received = np.stack([as_array(s.received[0]) for s in stats]).reshape(layers * heads, lk)
    received_bytes, received_hi = log_bytes(received)
    rows = [int(r) % lq for r in rows]
    weights = np.stack([as_array(w[0]) for w in row_weights]) if rows else np.zeros((layers, heads, 0, lk))
    # (layers, heads, R, Lk) -> (R, layers, heads, Lk): one block per chosen row
    weights = weights.transpose(2, 0, 1, 3).reshape(len(rows) * layers * heads, lk)
    weight_bytes, weight_hi = log_bytes(weights)
    return {
        "title": str(title),
        "tokens": tokens,
        "layerNames": names or [f"layer {i}" for i in range(layers)],
        "layers": layers,
        "heads": heads,
        "length": lk,
        "rows": rows,
        "decades": DECADES,
        "summary": summary,
        "received": base64.b64encode(received_bytes.tobytes()).decode("ascii"),
        "receivedHi": received_hi,
        "weights": base64.b64encode(weight_bytes.tobytes()).decode("ascii"),
        "weightsHi": weight_hi,
    }


def long_html(
    stats: Sequence[StatsView],
    tokens: Sequence[str],
    rows: Sequence[int],
    row_weights: Sequence[torch.Tensor],
    **kwargs: Any,
) -> str:
    """The HTML page (see the module docstring); raises if it would exceed :data:`MAX_PAGE_BYTES`."""
    data = long_data(stats, tokens, rows, row_weights, **kwargs)
    page = fill(
        asset("long.html"),
        title=html.escape(printable(data["title"])),
        style=font_face(" ".join([data["title"], *data["tokens"][:20000]])),
        data=script_json(data),
    )
    size = len(page.encode("utf-8"))
    if size > MAX_PAGE_BYTES:
        raise AttnkitValueError(
            f"the page would take {size / 2**20:.1f} MB (over {MAX_PAGE_BYTES / 2**20:.0f} MB): choose fewer rows "
            "(--rows) or a shorter text."
        )
    return page


def save_long_html(
    path: PathLike,
    stats: Sequence[StatsView],
    tokens: Sequence[str],
    rows: Sequence[int],
    row_weights: Sequence[torch.Tensor],
    **kwargs: Any,
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(long_html(stats, tokens, rows, row_weights, **kwargs), encoding="utf-8")
    return path


def long_figures(
    folder: PathLike,
    stats: Sequence[StatsView],
    tokens: Sequence[str],
    rows: Sequence[int],
    row_weights: Sequence[torch.Tensor],
    *,
    title: str = "attention over a long input",
    marks: dict | None = None,
) -> list[Path]:
    """PNGs: ``long_heads.png`` (per layer x head: entropy, sink mass, mean distance),
    ``long_keymass.png`` (mass each key receives, per layer) and ``long_rows.png`` (the chosen
    rows' weights over the text, per layer and head). ``marks``: ``{label: position}`` drawn
    as vertical lines (e.g. the needle)."""
    Figure = new_figure()
    from matplotlib.ticker import FuncFormatter

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    layers = len(stats)
    heads = stats[0].entropy.shape[-2]
    lk = stats[0].received.shape[-1]
    marks = marks or {}
    written = []

    fig = Figure(figsize=(3.2 * 3, 0.45 * layers + 1.6), layout="constrained")
    axes = fig.subplots(1, 3)
    for ax, (name, label) in zip(
        axes,
        (
            ("entropy", "mean entropy (bits)"),
            ("sink_mass", "mass on the first token"),
            ("mean_distance", "mean distance (tokens)"),
        ),
    ):
        grid = np.array(
            [[float(x) * (BITS if name == "entropy" else 1.0) for x in s.head_summary()[name]] for s in stats]
        )
        log = name == "mean_distance" and grid.min() > 0 and grid.max() >= 10 * grid.min()  # a wide range of distances
        im = ax.imshow(grid, cmap="viridis", aspect="auto", norm="log" if log else None)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(heads))
        ax.set_yticks(range(layers))
        bar = fig.colorbar(im, ax=ax, shrink=0.8)
        if name == "mean_distance":  # tokens: whole numbers, never an offset or 4.1 x 10^3 labels
            bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
            bar.ax.yaxis.set_minor_formatter(FuncFormatter(lambda x, _: ""))
            bar.ax.yaxis.get_offset_text().set_visible(False)
    fig.suptitle(title if f"{lk:,} tokens" in title else f"{title} ({lk:,} tokens)", fontsize=10)
    written.append(folder / "long_heads.png")
    fig.savefig(written[-1], dpi=110)

    bins = min(lk, 2000)
    edges = np.linspace(0, lk, bins + 1).astype(int)

    def binned(values):  # (n, Lk) -> (n, bins): the largest value of each bin
        return np.maximum.reduceat(values, edges[:-1], axis=-1)

    fig = Figure(figsize=(10, 3.2), layout="constrained")
    ax = fig.subplots()
    for i, s in enumerate(stats):
        mass = as_array(s.received[0]).mean(axis=0)  # mean over heads
        ax.plot((edges[:-1] + edges[1:]) / 2, np.clip(binned(mass[None])[0], 1e-12, None), lw=0.8, label=f"layer {i}")
    for label, pos in marks.items():
        ax.axvline(pos, color="red", lw=0.8, ls="--")
        ax.annotate(label, (pos, 1), xycoords=("data", "axes fraction"), fontsize=8, color="red", va="top")
    ax.set_yscale("log")
    ax.set_xlabel("key position")
    ax.set_ylabel("mass received (max per bin)")
    ax.set_title(f"{title}: how much attention each key receives", fontsize=10)
    ax.legend(fontsize=7, ncol=min(layers, 6))
    written.append(folder / "long_keymass.png")
    fig.savefig(written[-1], dpi=110)

    if rows:
        shown = rows[:4]
        fig = Figure(figsize=(10, 1.7 * layers * len(shown) + 0.8), layout="constrained")
        axes = fig.subplots(len(shown) * layers, 1, squeeze=False, sharex=True)
        centres = (edges[:-1] + edges[1:]) / 2
        for ri, row in enumerate(shown):
            for layer in range(layers):
                ax = axes[ri * layers + layer, 0]
                w = as_array(row_weights[layer][0, :, ri])  # (heads, Lk)
                for head, line in enumerate(binned(w)):
                    ax.plot(centres, line, lw=0.8, label=f"head {head}")
                for label, pos in marks.items():
                    ax.axvline(pos, color="red", lw=0.6, ls="--")
                    if layer == 0:
                        ax.annotate(f" {label} ({pos:,})", (pos, 0.97), xycoords=("data", "axes fraction"),
                                    fontsize=7, color="red", va="top")  # fmt: skip
                ax.set_ylim(0, 1.08 * max(float(w.max(initial=0.0)), 1e-6))  # each panel to what it holds
                ax.set_ylabel(f"layer {layer}\nweight", fontsize=8)
                ax.tick_params(labelsize=7)
                if layer == 0:
                    ax.set_title(
                        f"query row {row} ({printable(str(tokens[row]))}): its weight on each key "
                        f"(max per bin of {max(1, lk // bins)} tokens)",
                        fontsize=9,
                    )
                    ax.legend(fontsize=6, ncol=min(heads, 6), loc="upper right")
        axes[-1, 0].set_xlabel("key position")
        written.append(folder / "long_rows.png")
        fig.savefig(written[-1], dpi=110)
    return written
