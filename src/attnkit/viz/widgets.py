"""``attnkit.viz.widget``: attention in a live notebook widget (on ``anywidget``, the ``widget`` extra).

The widget opens on the layer x head grid (entropy, largest weight, first-token mass or mean
distance per head, coloured), and a click on a head shows that head below it: the weights as a
heatmap with the tokens under the pointer (short inputs), or at long context the mass each key
receives, each query's entropy and the chosen rows' weights over the whole text, with the keys
they favour. Only the grid is sent when the widget opens; a head's view is computed in Python
when it is picked (``selected``), from statistics rather than ``L x L`` weights at long context,
and profiles over more than ``bins`` tokens are binned (the largest value of each bin), so a
32k-token view stays well under :data:`attnkit.viz.notebook.LONG_BUDGET`.
"""

from __future__ import annotations

import base64
import html
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from attnkit._validate import AttnkitTypeError, AttnkitValueError, short
from attnkit.viz.html import asset, cut_labels, fill, font_face
from attnkit.viz.long import BITS, DECADES, StatsView, bin_profile, log_bytes

__all__ = ["MAX_WEIGHTS", "static_view", "widget"]

#: The most weights (query rows x keys) one head's heatmap sends; longer inputs use statistics.
MAX_WEIGHTS = 1024 * 1024
_TOP = 8
_CLASS: type | None = None


def _widget_class() -> type:
    """The anywidget class, made on first use so that attnkit imports without the extra."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    try:
        import anywidget
        import traitlets
    except ImportError as error:
        raise ImportError(
            "attnkit.viz.widget needs anywidget: pip install 'attnkit[widget]' (or pip install anywidget). "
            "Without it, a Capture or AttentionStats shows itself inline as a page (its _repr_html_)."
        ) from error

    class AttentionWidget(anywidget.AnyWidget):
        """The grid of heads and the picked head's view; ``selected = [layer, head]`` picks one
        (``[-1, -1]``: the grid alone), from the notebook or in Python (:meth:`select`)."""

        _esm = asset("widget.js")
        _css = traitlets.Unicode(asset("widget.css")).tag(sync=True)
        data = traitlets.Dict().tag(sync=True)
        selected = traitlets.List(traitlets.Int(), default_value=[-1, -1]).tag(sync=True)
        #: Query rows whose weights are combined into one profile (clicks on the heatmap's rows,
        #: or the captured rows' boxes at long context), and how: "mean" or "sum".
        rows = traitlets.List(traitlets.Int(), default_value=[]).tag(sync=True)
        combine = traitlets.Unicode("mean").tag(sync=True)
        detail = traitlets.Dict().tag(sync=True)

        def __init__(self, data: dict, view: Callable[..., dict], css: str = "", **kwargs: Any):
            super().__init__(data=data, **kwargs)
            self._css = css + asset("widget.css")
            self._view = view
            self.observe(self._picked, names=["selected", "rows", "combine"])

        def _picked(self, change) -> None:
            layer, head = self.selected
            if layer < 0:
                self.detail = {}
                return
            if not (0 <= layer < self.data["layers"] and 0 <= head < self.data["heads"]):
                raise AttnkitValueError(
                    f"no head ({layer}, {head}): this widget has {self.data['layers']} layers of "
                    f"{self.data['heads']} heads."
                )
            self.detail = self._view(layer, head, list(self.rows), self.combine)

        def select(self, layer: int, head: int) -> None:
            """Show ``head`` of ``layer`` (as a click on its cell does)."""
            self.selected = [int(layer), int(head)]

        def select_rows(self, rows: Sequence[int], how: str = "mean") -> None:
            """Combine the weights of query ``rows`` (positions; negative ones count from the end) into
            one profile over the keys, their ``"mean"`` or ``"sum"`` (as clicks on the heatmap's rows
            do); ``[]`` clears the selection. At long context only the rows the capture kept
            (``capture(..., rows=)``) have weights to combine."""
            if how not in ("mean", "sum"):
                raise AttnkitValueError(f"how must be 'mean' or 'sum', but got {how!r}.")
            if isinstance(rows, (str, bytes)) or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows):
                raise AttnkitTypeError(f"rows must be a sequence of ints (query positions), but got {rows!r}.")
            queries = self.data["queries"]
            bad = [r for r in rows if not -queries <= r < queries]
            if bad:
                raise AttnkitValueError(f"rows {bad} are out of range for {queries} query rows.")
            chosen = sorted({r % queries for r in rows})
            kept = self.data.get("rowsKept")
            if kept is not None and not set(chosen) <= set(kept):
                raise AttnkitValueError(
                    f"rows {sorted(set(chosen) - set(kept))} were not captured: at long context the widget has the "
                    f"weights of the rows the capture kept ({kept}); capture rows= those you want to combine."
                )
            with self.hold_trait_notifications():
                self.combine = how
                self.rows = chosen

        def _ipython_display_(self) -> None:
            """Two outputs: the grid as a static picture (what an exported notebook, nbconvert's HTML
            or GitHub's viewer shows, with no widget manager to load), then the live widget, which
            hides the picture once it renders."""
            from IPython.display import HTML, display

            display(HTML(static_view(self.data)))
            bundle = self._repr_mimebundle_()  # anywidget's: (data, metadata)
            data, metadata = bundle if isinstance(bundle, tuple) else (bundle, {})
            display(data, metadata=metadata, raw=True)

    _CLASS = AttentionWidget
    return _CLASS


def static_view(data: dict) -> str:
    """The widget's grid as a self-contained HTML snippet (a PNG of the layer x head grid coloured by
    its first statistic, entropy where it has it): the output an export shows without a widget manager."""
    import io

    from matplotlib.figure import Figure  # no pyplot: the notebook's backend is left as it is

    metric = next(iter(data["summary"]))
    grid = np.asarray(data["summary"][metric], dtype=float)  # (layers, heads)
    layers, heads = grid.shape
    fig = Figure(figsize=(1.2 + 0.55 * heads, 0.9 + 0.4 * layers), dpi=100)
    ax = fig.add_subplot()
    image = ax.imshow(grid, cmap="Blues", aspect="auto")
    if layers * heads <= 400:
        hi, lo = np.nanmax(grid), np.nanmin(grid)
        for (i, j), x in np.ndenumerate(grid):
            dark = hi > lo and (x - lo) / (hi - lo) > 0.6
            ax.text(j, i, f"{x:.1f}" if metric == "mean_distance" else f"{x:.2f}", ha="center", va="center",
                    fontsize=7, color="white" if dark else "#222")  # fmt: skip
    ax.set_xticks(range(heads), [str(h) for h in range(heads)], fontsize=8)
    ax.set_yticks(range(layers), data["layerNames"], fontsize=8)
    ax.set_xlabel("head", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02).ax.tick_params(labelsize=7)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    names = {"entropy": "entropy (bits)", "max_weight": "largest weight", "sink_mass": "first-token mass"}
    return fill(
        asset("widget_static.html"),
        id=data["staticId"], title=html.escape(data["title"]), layers=_plural(layers, "layer"),
        heads=_plural(heads, "head"), length=_plural(data["length"], "token"),
        metric=names.get(metric, metric.replace("_", " ")),
        alt=html.escape(f"{data['title']}: {metric} per head, {_plural(layers, 'layer')} x {_plural(heads, 'head')}"),
        png=base64.b64encode(buffer.getvalue()).decode("ascii"),
    )  # fmt: skip


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _labels(tokens: Sequence[object] | None, length: int) -> list[str]:
    if tokens is None:
        return [str(i) for i in range(length)]
    labels, _ = cut_labels(tokens)
    if len(labels) != length:
        raise AttnkitValueError(f"got {len(labels)} tokens for {length} keys: pass one token per key.")
    return labels


def _binned(values: np.ndarray, bins: int, how: str = "max") -> tuple[list[float], int]:
    """:func:`~attnkit.viz.long.bin_profile` as JSON numbers (four significant digits)."""
    points, size = bin_profile(values, bins, how)
    return [float(f"{x:.4g}") for x in points], size


def _top(values: np.ndarray, labels: list[str]) -> list[dict]:
    order = np.argsort(-values, kind="stable")[:_TOP]
    return [{"position": int(j), "token": labels[j], "value": float(values[j])} for j in order if values[j] > 0]


def _weights_source(weights: Sequence[torch.Tensor], tokens, batch: int):
    """``data`` and the per-head view of full weights ``(B, H, Lq, Lk)`` per layer."""
    lq, lk = weights[0].shape[-2:]
    if lq * lk > MAX_WEIGHTS:
        raise AttnkitValueError(
            f"a head's weights are {lq} x {lk} (over {MAX_WEIGHTS:,}): too many for the widget. Capture "
            "mode='stats' (with rows= for the rows to look at) for long inputs."
        )
    keys = _labels(tokens, lk)
    queries = keys[-lq:] if lq <= lk else [str(i) for i in range(lq)]
    mats = [w[min(batch, w.shape[0] - 1)].detach().to("cpu", torch.float64) for w in weights]  # (H, Lq, Lk)
    entropy = [(-(m * torch.log(m.clamp_min(1e-300))).sum(-1) * BITS).mean(-1).tolist() for m in mats]
    summary = {
        "entropy": entropy,
        "max_weight": [m.amax(-1).mean(-1).tolist() for m in mats],
        "sink_mass": [m[..., 0].mean(-1).tolist() for m in mats],
    }

    def view(layer: int, head: int, rows: Sequence[int] = (), how: str = "mean") -> dict:
        values, (hi,) = log_bytes(mats[layer][head].reshape(1, -1).numpy())
        out = {
            "kind": "weights", "layer": layer, "head": head, "rows": lq, "cols": lk, "hi": hi, "decades": DECADES,
            "bytes": base64.b64encode(values.tobytes()).decode("ascii"), "queryTokens": queries, "keyTokens": keys,
        }  # fmt: skip
        if rows:
            out["selection"] = _selection(mats[layer][head][list(rows)].numpy(), rows, how, keys, lk + 1)
        return out

    return summary, lk, lq, view, keys


def _selection(weights: np.ndarray, rows: Sequence[int], how: str, keys: list[str], bins: int) -> dict:
    """The combined profile of query ``rows``' weights ``(len(rows), Lk)``: their mean or sum over the
    keys, binned (the largest of each bin) past ``bins`` keys, and the keys it favours."""
    combined = weights.sum(0) if how == "sum" else weights.mean(0)
    points, size = _binned(combined, bins)
    return {"rows": [int(r) for r in rows], "how": how, "weights": points, "binSize": size, "top": _top(combined, keys)}


def _stats_source(stats: Sequence, rows: Sequence[int], row_weights: Sequence[torch.Tensor], tokens, batch, bins):
    """``data`` and the per-head view of :class:`AttentionStats` per layer (and chosen rows' weights)."""
    lq, lk = stats[0].entropy.shape[-1], stats[0].received.shape[-1]
    keys = _labels(tokens, lk)
    summary: dict[str, list] = {name: [] for name in ("entropy", "max_weight", "sink_mass", "mean_distance")}
    for s in stats:
        found = s.head_summary()
        for name in summary:
            scale = BITS if name == "entropy" else 1.0
            summary[name].append([float(x) * scale for x in found[name]])
    rows = [int(r) % lq for r in rows]

    def view(layer: int, head: int, chosen: Sequence[int] = (), how: str = "mean") -> dict:
        s = stats[layer]
        b = min(batch, s.received.shape[0] - 1)
        received = s.received[b, head].double().numpy()
        entropy = (s.entropy_bits[b, head].double()).numpy()
        out: dict[str, Any] = {"kind": "stats", "layer": layer, "head": head, "rows": rows}
        out["rowTokens"] = [keys[r] for r in rows]
        out["received"], out["binSize"] = _binned(received, bins)
        out["entropy"], _ = _binned(entropy, bins, "mean")
        out["topReceived"] = _top(received, keys)
        out["rowWeights"], out["rowTop"] = [], []
        for i in range(len(rows)):
            w = row_weights[layer][b, head, i].double().numpy()
            out["rowWeights"].append(_binned(w, bins)[0])
            out["rowTop"].append(_top(w, keys))
        if chosen:
            at = [rows.index(r) for r in chosen]  # select_rows admits captured rows only
            picked = row_weights[layer][b, head][at].double().numpy()
            out["selection"] = _selection(picked, chosen, how, keys, bins)
        return out

    return summary, lk, lq, view, keys


def _is_capture(source: object) -> bool:
    """An :class:`attnkit.Capture`, read by its shape (viz imports nothing of inspect): what it
    recorded (``mode``, ``stats``, ``weights``, ``rows``, ``heads``, ``names``) and ``rows_of``."""
    return all(hasattr(source, name) for name in ("mode", "stats", "weights", "rows", "heads", "names", "rows_of"))


def widget(
    source: Any,
    tokens: Sequence[object] | None = None,
    *,
    batch: int = 0,
    bins: int = 1024,
    title: str = "attention",
    names: Sequence[str] | None = None,
) -> Any:
    """A live view of attention in a notebook: the layer x head grid; click a head to look at it.

    ``source``: a :class:`~attnkit.Capture` (``mode="weights"`` with whole rows, or
    ``mode="stats"``, whose chosen ``rows=`` are drawn over the whole text), an
    :class:`~attnkit.inspect.AttentionStats` or a list of them (one per layer), or weights as
    :func:`attnkit.viz.save_html` takes them (``(layers, heads, Lq, Lk)``, or a list of ``(B, H,
    Lq, Lk)`` per layer). ``tokens``: one label per key (default: the capture's ``tokens``, else
    positions). ``batch``: the sequence shown. ``bins``: profiles over more tokens than this are
    binned. Needs the ``widget`` extra (``pip install 'attnkit[widget]'``).

    Returns an ``anywidget.AnyWidget``: display it (the last line of a cell); ``w.select(layer,
    head)`` or a click picks a head, ``w.selected`` reads the pick. Several query rows combine into
    one profile over the keys, their mean or sum (what a sentence or a phrase looks at): click rows
    of the heatmap (shift-click for a range), tick the captured rows at long context, or
    ``w.select_rows([3, 4, 5], how="sum")``; ``w.detail["selection"]`` holds the profile and the
    keys it favours.
    """
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 8:
        raise AttnkitValueError(f"bins must be an int >= 8, but got {bins!r}.")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise AttnkitValueError(f"batch must be a non-negative int, but got {batch!r}.")
    rows: list[int] = []
    row_weights: list[torch.Tensor] = []
    if _is_capture(source):
        tokens = getattr(source, "tokens", None) if tokens is None else tokens
        names = source.names if names is None else names
        if source.mode == "stats" and source.stats:
            stats, rows = list(source.stats), source.rows_of(source.stats[0].entropy.shape[-1])
            row_weights = list(source.weights) if rows else []
        elif source.mode == "weights" and source.weights and source.rows is None and source.heads is None:
            stats, weights = None, list(source.weights)
        else:
            raise AttnkitValueError(
                f"this capture (mode={source.mode!r}, {len(source.names)} layers) holds nothing the widget draws: "
                "capture mode='weights' without rows=/heads=, or mode='stats', and run the model inside the block."
            )
    elif isinstance(source, StatsView) or (
        isinstance(source, (list, tuple)) and source and all(isinstance(s, StatsView) for s in source)
    ):
        stats = [source] if isinstance(source, StatsView) else list(source)
    elif isinstance(source, torch.Tensor) or (
        isinstance(source, (list, tuple)) and source and all(isinstance(w, torch.Tensor) for w in source)
    ):
        stats = None
        if isinstance(source, (list, tuple)):
            weights = [w if w.dim() == 4 else w[None] for w in source]
        else:
            if source.dim() != 4:
                raise AttnkitValueError(
                    "weights must be (layers, heads, Lq, Lk), or a list of (B, H, Lq, Lk), but got "
                    f"{tuple(source.shape)}."
                )
            weights = [w[None] for w in source]
    else:
        raise AttnkitTypeError(
            "widget takes a Capture, AttentionStats (or a list of them, one per layer) or attention weights, "
            f"but got {short(source)}."
        )
    layers = len(stats) if stats is not None else len(weights)
    if stats is not None:
        if batch >= stats[0].received.shape[0]:
            raise AttnkitValueError(f"batch={batch}, but the statistics hold {stats[0].received.shape[0]} sequences.")
        summary, length, queries, view, keys = _stats_source(stats, rows, row_weights, tokens, batch, bins)
        heads = stats[0].entropy.shape[-2]
    else:
        if len({tuple(w.shape[1:]) for w in weights}) != 1:
            raise AttnkitValueError("every layer's weights must have the same (H, Lq, Lk) shape.")
        if batch >= weights[0].shape[0]:
            raise AttnkitValueError(f"batch={batch}, but the weights hold {weights[0].shape[0]} sequences.")
        summary, length, queries, view, keys = _weights_source(weights, tokens, batch)
        heads = weights[0].shape[1]
    names = [str(n) for n in names] if names is not None else [f"layer {i}" for i in range(layers)]
    if len(names) != layers:
        raise AttnkitValueError(f"got {len(names)} layer names for {layers} layers.")
    data = {
        "title": str(title), "layers": layers, "heads": int(heads), "length": int(length), "queries": int(queries),
        "layerNames": names, "summary": summary, "staticId": uuid.uuid4().hex[:12],
    }  # fmt: skip
    if stats is not None:  # at long context only the captured rows have weights to combine
        data["rowsKept"] = sorted({int(r) % queries for r in rows})
    return _widget_class()(data, view, css=font_face(" ".join(keys[:20000])))
