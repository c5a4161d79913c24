"""A self-contained interactive HTML view of attention weights.

One file, inline CSS and JavaScript (kept in ``attnkit/viz/static``), nothing fetched: it opens from a ``file://``
URL with the network off. Three views:

- model view: a thumbnail of every layer x head; click one to open it;
- head view: query tokens on the left, key tokens on the right, joined by lines
  whose opacity is the weight; the heads of a layer are toggled by coloured
  squares; hovering a token keeps only its lines;
- heatmap: the selected head (or the mean of a layer's heads) with token labels and
  axis labels naming what the rows and columns are, the value under the pointer.

A page can open on any of them, or on an overview above them that answers the page's
question in words and bars (:func:`bars_overview`) or over a waveform
(:func:`waveform_overview`).

Weights are stored as one byte per weight (scaled by each head's maximum) in
base64, so 128 tokens x 6 layers x 12 heads takes about 1.6 MB. Text from the
user reaches the page only through ``textContent`` and canvas text, never as HTML.
"""

from __future__ import annotations

import base64
import html
import json
import re
import unicodedata
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from attnkit._types import ArrayLike, PathLike
from attnkit._validate import AttnkitValueError
from attnkit.viz.heatmap import as_array

#: The most weights one file holds (about 21 MB of HTML).
MAX_CELLS = 16_000_000
#: The head view draws lines for at most this many tokens per side.
MAX_LINE_TOKENS = 256
#: Token labels longer than this many characters are cut (the page says so): the page's
#: size is bounded by the number of weights, never by what the token text holds.
MAX_LABEL = 48
#: The page title and layer names are cut at these lengths.
MAX_TITLE, MAX_NAME = 300, 80


def cut_labels(labels: Iterable[object], limit: int = MAX_LABEL) -> tuple[list[str], int]:
    """``labels`` as str, each cut to ``limit`` characters with an ellipsis; and how many were cut."""
    out, cut = [], 0
    for label in labels:
        label = str(label)
        if len(label) > limit:
            label, cut = label[: limit - 1] + "\u2026", cut + 1
        out.append(label)
    return out, cut


def asset(name: str) -> str:
    """A file of the page (HTML, CSS or JavaScript) shipped in ``attnkit/viz/static``."""
    return (resources.files("attnkit.viz") / "static" / name).read_text(encoding="utf-8")


def fill(template: str, **values: str) -> str:
    """Replace each ``{{name}}`` of ``template`` in one pass: inserted text is never read again."""
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)] if m.group(1) in values else m.group(0), template)


def printable(text: str) -> str:
    """``text`` without control and bidirectional-override characters (for the page title)."""
    return "".join(ch for ch in text if unicodedata.category(ch) not in ("Cc", "Cf"))


def script_json(value: object) -> str:
    """JSON that is safe inside a <script> element (no "</script>", no HTML parsing)."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    for raw, escaped in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(raw, escaped)
    return text


def attention_html(
    weights: ArrayLike,
    tokens: Sequence[str],
    *,
    key_tokens: Sequence[str] | None = None,
    layer_names: Sequence[str] | None = None,
    title: str = "attention",
    axes: tuple[str, str] = ("query token", "key token"),
    start: str | None = None,
    focus: tuple[int, int | None] = (0, 0),
    overview: dict | None = None,
) -> str:
    """The HTML page for ``weights: (layers, heads, Lq, Lk)`` over ``tokens``.

    ``key_tokens`` default to ``tokens`` (self-attention); ``layer_names`` label the rows.
    ``axes`` name what the rows and the columns are (the heatmap's axis labels and the
    header), e.g. ``("output character", "input character")``. ``start`` is the view the page
    opens on: ``"overview"`` (the default when ``overview`` is given), ``"model"`` (the default
    otherwise), ``"head"`` or ``"heatmap"``; ``focus = (layer, head)`` is the head the heatmap
    and head views open on, head ``None`` for the mean of the layer's heads. ``overview`` is the
    page's answer in plain words, made by :func:`bars_overview` or :func:`waveform_overview`.
    """
    import numpy as np

    array = as_array(weights)
    if array.ndim != 4:
        raise AttnkitValueError(f"weights must have shape (layers, heads, Lq, Lk), but got {array.shape}.")
    layers, heads, lq, lk = array.shape
    if min(array.shape) == 0:
        raise AttnkitValueError(
            f"weights of shape {array.shape} hold nothing to draw: the page needs at least one layer, "
            "head, query token and key token."
        )
    tokens = [str(t) for t in tokens]
    key_tokens = tokens if key_tokens is None else [str(t) for t in key_tokens]
    if len(tokens) != lq or len(key_tokens) != lk:
        raise AttnkitValueError(
            f"weights of shape {array.shape} need {lq} query tokens and {lk} key tokens, "
            f"but got {len(tokens)} and {len(key_tokens)}."
        )
    if array.size > MAX_CELLS:
        raise AttnkitValueError(
            f"{layers} layers x {heads} heads x {lq} x {lk} tokens = {array.size:,} weights is more "
            f"than one page holds ({MAX_CELLS:,}). Pick some layers or heads, or a shorter text."
        )
    start = start or ("overview" if overview is not None else "model")
    if start not in ("overview", "model", "head", "heatmap") or (start == "overview" and overview is None):
        raise AttnkitValueError(
            f"start must be 'model', 'head', 'heatmap' or (with an overview) 'overview', but got {start!r}."
        )
    if len(focus) != 2 or not 0 <= focus[0] < layers or not (focus[1] is None or 0 <= focus[1] < heads):
        raise AttnkitValueError(
            f"focus must be (layer, head) with layer in 0..{layers - 1} and head in 0..{heads - 1} or None "
            f"(the mean of heads), but got {focus!r}."
        )
    if len(axes) != 2 or not all(isinstance(a, str) for a in axes):
        raise AttnkitValueError(f"axes must be two strings (rows, columns), but got {axes!r}.")
    names = [str(n) for n in layer_names] if layer_names is not None else [f"layer {i}" for i in range(layers)]
    names, _ = cut_labels(names, MAX_NAME)
    (title,), _ = cut_labels([title], MAX_TITLE)
    same = key_tokens is tokens  # self-attention: one list of labels
    tokens, cut_q = cut_labels(tokens)
    key_tokens, cut_k = (tokens, 0) if same else cut_labels(key_tokens)
    note = f"{cut_q + cut_k} token labels longer than {MAX_LABEL} characters are cut" if cut_q + cut_k else ""
    array = np.nan_to_num(np.clip(array, 0.0, None))
    scale = array.reshape(layers * heads, -1).max(axis=1, initial=0.0)
    safe = np.where(scale > 0, scale, 1.0)[:, None]
    quantized = np.rint(array.reshape(layers * heads, -1) / safe * 255).astype(np.uint8)
    data = {
        "title": str(title),
        "note": note,
        "tokens": tokens,
        "keyTokens": key_tokens,
        "layerNames": names,
        "layers": layers,
        "heads": heads,
        "lq": lq,
        "lk": lk,
        "scale": [float(x) for x in scale],
        "maxLineTokens": MAX_LINE_TOKENS,
        "axes": [cut_labels([a], MAX_NAME)[0][0] for a in axes],
        "start": start,
        "focus": [int(focus[0]), -1 if focus[1] is None else int(focus[1])],
        "overview": overview,
        "weights": base64.b64encode(quantized.tobytes()).decode("ascii"),
    }
    return fill(
        asset("attention.html"),
        title=html.escape(printable(str(title))),
        style=font_face(" ".join([str(title), *tokens, *key_tokens, *names, *axes, _overview_text(overview)]))
        + asset("attention.css"),
        script=asset("attention.js"),
        data=script_json(data),
    )


def bars_overview(
    heading: str,
    items: Sequence[tuple[str, Sequence[tuple[str, float]]]],
    note: str = "",
    captions: Sequence[str] | None = None,
    digits: int = 2,
) -> dict:
    """An overview for :func:`attention_html`: a numbered list of ``(title, [(label, value), ...])``,
    each value drawn as a bar on one scale for all items (the largest value of any item fills
    its track, so that items compare), e.g. recommended movies, each with the history it drew
    on. ``captions`` (one per item) are shown under the titles."""
    import math

    if captions is not None and len(captions) != len(items):
        raise AttnkitValueError(f"captions must have one entry per item ({len(items)}), but got {len(captions)}.")
    rows = []
    for n, (title, bars) in enumerate(items):
        bad = [(label, v) for label, v in bars if not math.isfinite(float(v))]
        if bad:
            raise AttnkitValueError(f"bar values must be finite numbers, but item {n} ({title!r}) has {bad[:3]}.")
        (title,), _ = cut_labels([title], MAX_TITLE)
        labels, _ = cut_labels([label for label, _ in bars], MAX_TITLE)
        row = {"title": title, "bars": [[label, float(v)] for label, (_, v) in zip(labels, bars)]}
        if captions is not None:
            row["caption"] = str(captions[n])
        rows.append(row)
    scale = max((float(v) for _, bars in items for _, v in bars), default=0.0)
    return {
        "kind": "bars",
        "heading": str(heading),
        "note": str(note),
        "items": rows,
        "digits": int(digits),
        "scale": max(scale, 1e-12),
    }


def waveform_overview(
    heading: str,
    samples: ArrayLike,
    sample_rate: int,
    spans: Sequence[tuple[str, float, float]],
    note: str = "",
    points: int = 900,
) -> dict:
    """An overview for :func:`attention_html`: the waveform (a min/max envelope of ``points``
    columns) with each ``(label, start_s, end_s)`` span shaded and labelled over it, e.g. the
    stretch of audio each transcribed character attended to."""
    import math

    import numpy as np

    x = np.asarray(samples, dtype=np.float64).reshape(-1)
    if x.size == 0 or sample_rate <= 0:
        raise AttnkitValueError(f"the waveform needs samples and a positive sample rate, but got {x.size} samples.")
    if not np.isfinite(x).all():
        raise AttnkitValueError("the waveform holds NaN or Inf samples.")
    bad = [s for s in spans if not (math.isfinite(float(s[1])) and math.isfinite(float(s[2])) and s[1] <= s[2])]
    if bad:
        raise AttnkitValueError(f"spans must be (label, start_s, end_s) with finite start <= end, but got {bad[:3]}.")
    top = max(float(np.abs(x).max()), 1e-9)
    edges = np.linspace(0, x.size, min(points, x.size) + 1).astype(int)
    envelope = []
    for a, b in zip(edges[:-1], edges[1:]):
        part = x[a : max(b, a + 1)] / top
        envelope += [round(float(part.min()), 3), round(float(part.max()), 3)]
    labels, _ = cut_labels([s[0] for s in spans], MAX_NAME)
    return {
        "kind": "waveform",
        "heading": str(heading),
        "note": str(note),
        "seconds": x.size / sample_rate,
        "envelope": envelope,
        "spans": [[label, float(s), float(e)] for label, (_, s, e) in zip(labels, spans)],
    }


def _overview_text(overview: dict | None) -> str:
    """Every piece of text an overview shows (for the glyphs the page embeds)."""
    if overview is None:
        return ""
    parts = [overview.get("heading", ""), overview.get("note", "")]
    for item in overview.get("items", []):
        parts += [item["title"], item.get("caption", ""), *(label for label, _ in item["bars"])]
    parts += [label for label, *_ in overview.get("spans", [])]
    return " ".join(parts)


#: The family of the glyphs a page embeds (see :func:`font_face`); the CSS and the
#: canvases list it first, so characters the system fonts lack are drawn from it.
GLYPH_FAMILY = "attnkit-glyphs"


def font_face(text: str) -> str:
    """An ``@font-face`` carrying the page's non-ASCII glyphs ('' when it has none).

    A fresh machine may have no CJK fonts: without this, the browser would draw the
    tutorial's Chinese tokens as empty boxes. Only the glyphs the page shows are
    embedded (a few hundred bytes each), cut from the Noto Sans CJK font that also
    labels the PNGs.
    """
    from attnkit.viz._fonts import glyph_subset

    font = glyph_subset(text)
    if font is None:
        return ""
    encoded = base64.b64encode(font).decode("ascii")
    return (
        f'@font-face {{ font-family: "{GLYPH_FAMILY}"; '
        f'src: url(data:font/otf;base64,{encoded}) format("opentype"); }}\n'
    )


def save_html(path: PathLike, weights: ArrayLike, tokens: Sequence[str], **kwargs: Any) -> Path:
    """Write :func:`attention_html` to ``path``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(attention_html(weights, tokens, **kwargs), encoding="utf-8")
    return path


def effects_table(values: Sequence[Sequence[float]], names: Sequence[str], base: float, caption: str) -> str:
    """A table of one value per (layer, head) (``values``, layers down), each cell shaded by its
    distance from ``base`` (red above, blue below, the largest distance full): head effects."""
    reach = max((abs(v - base) for row in values for v in row), default=0.0) or 1.0
    rows = []
    for i, (name, row) in enumerate(zip(names, values)):
        cells = []
        for h, value in enumerate(row):
            t = max(-1.0, min(1.0, (value - base) / reach))
            color = f"rgba(178,24,43,{t:.2f})" if t > 0 else f"rgba(33,102,172,{-t:.2f})"
            tip = html.escape(f"layer {i}, head {h}: {value:.4g}", quote=True)
            cells.append(f'<td title="{tip}" style="background:{color}">{value:.3g}</td>')
        rows.append(f"<tr><th>{i}: {html.escape(str(name))}</th>{''.join(cells)}</tr>")
    header = "".join(f"<th>{h}</th>" for h in range(max((len(r) for r in values), default=0)))
    return fill(asset("head_effects.html"), caption=html.escape(caption), header=header, rows="\n".join(rows))
