"""Relevance of each input token (``attnkit.inspect.rollout``'s result) as text shaded by it.

:func:`relevance` wraps a ``(B, R, L)`` relevance tensor and a token list in a view that a
notebook shows inline (``_repr_html_``) and :meth:`RelevanceView.save_html` writes as a page.
Each chosen row is a paragraph of the tokens, each shaded by its relevance (relative to the
row's largest, on a linear scale), with the ten most relevant tokens listed. Past
:data:`MAX_SHADED` tokens only the profile (binned: the largest of each bin) and the top tokens
with a few words of context are drawn, so 32k tokens stay small.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import torch

from attnkit._types import PathLike
from attnkit._validate import AttnkitTypeError, AttnkitValueError, short
from attnkit.viz.html import cut_labels, font_face, printable
from attnkit.viz.long import bin_profile

__all__ = ["MAX_SHADED", "RelevanceView", "relevance"]

#: Rows of at most this many tokens are drawn as shaded text; longer ones as a profile.
MAX_SHADED = 4096
_TOP, _CONTEXT, _BINS = 10, 4, 600


class RelevanceView:
    """Shaded tokens per row: show it in a notebook, or :meth:`save_html`."""

    def __init__(self, values: torch.Tensor, tokens: list[str], rows: list[str], title: str):
        self.values, self.tokens, self.rows, self.title = values, tokens, rows, title

    def _row(self, name: str, r: torch.Tensor) -> str:
        top = float(r.max()) if r.numel() else 0.0
        order = torch.argsort(-r, stable=True)[:_TOP].tolist()
        esc = [html.escape(t) for t in self.tokens]
        parts = [f"<h2>{html.escape(name)}</h2>"]
        if len(esc) <= MAX_SHADED:
            spans = []
            for j, t in enumerate(esc):
                a = max(0.0, float(r[j])) / top if top > 0 else 0.0
                spans.append(
                    f'<span style="background:rgba(214,80,40,{a:.2f})" title="{j}: {float(r[j]):.3g}">{t}</span>'
                )
            parts.append(f'<p class="text">{" ".join(spans)}</p>')
        else:
            binned, size = bin_profile(r.numpy(), _BINS)
            peak = float(binned.max()) or 1.0
            points = " ".join(
                f"{(i + 0.5) * 1000 / len(binned):.1f},{118 - 112 * max(0.0, float(v)) / peak:.1f}"
                for i, v in enumerate(binned)
            )
            parts.append(
                f'<svg class="profile" width="1000" height="120"><polyline fill="none" stroke="#b04020" '
                f'points="{points}"/></svg><p class="hint">{len(esc):,} tokens, {size} per point (the largest).</p>'
            )
        items = []
        for j in order:
            lo, hi = max(0, j - _CONTEXT), min(len(esc), j + _CONTEXT + 1)
            context = " ".join(esc[lo:j]) + f" <b>{esc[j]}</b> " + " ".join(esc[j + 1 : hi])
            items.append(f"<li>{float(r[j]):.3g} at {j}: {context}</li>")
        parts.append(f'<ol class="top">{"".join(items)}</ol>')
        return "".join(parts)

    def html(self) -> str:
        """The whole page (self-contained: styles and the glyphs of the tokens inside)."""
        body = "".join(self._row(name, r) for name, r in zip(self.rows, self.values))
        style = font_face(" ".join(self.tokens[:20000]))
        return (
            f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(self.title)}</title><style>{style}'
            'body{font:14px system-ui,sans-serif,"attnkit-glyphs";margin:12px;color:#222}'
            "h1{font-size:16px;margin:0 0 4px}h2{font-size:14px;margin:12px 0 4px}.hint{color:#666;font-size:12px}"
            ".text{line-height:1.9}.text span{padding:1px 1px;border-radius:2px}.top{font-size:12px}"
            f'</style></head><body data-ready="1"><h1>{html.escape(self.title)}</h1>'
            '<p class="hint">Each token shaded by its relevance to the row (darkest: the most relevant); '
            "hover a token for its value.</p>"
            f"{body}</body></html>"
        )

    def _repr_html_(self) -> str:
        from attnkit.viz import notebook

        page = self.html()
        size = len(page.encode("utf-8"))
        budget = notebook.LONG_BUDGET if len(self.tokens) > 1024 else notebook.INLINE_BUDGET
        if size > budget:
            return notebook.too_big("relevance", size, budget, "Show fewer rows, or save_html() it.")
        height = min(900, 120 + len(self.rows) * (360 if len(self.tokens) > MAX_SHADED else 260))
        return notebook.iframe(page, height, "attnkit: relevance")

    def save_html(self, path: PathLike) -> Path:
        """Write :meth:`html` to ``path``; returns the path."""
        path = Path(path)
        path.write_text(self.html(), encoding="utf-8")
        return path


def relevance(
    values: torch.Tensor,
    tokens: Sequence[object] | None = None,
    *,
    rows: Sequence[object] | None = None,
    batch: int = 0,
    title: str = "relevance of each token",
) -> RelevanceView:
    """A view of ``values`` (``(B, R, L)`` from :func:`attnkit.inspect.rollout`, or ``(R, L)`` or
    ``(L,)``) over ``tokens`` (one per position; default positions), one paragraph per row.
    ``rows`` names the rows (e.g. the indices passed to rollout); ``batch`` picks the sequence.

    >>> import torch
    >>> view = relevance(torch.tensor([[0.1, 0.7, 0.2]]), ["the", "cat", "sat"], rows=["row -1"])
    >>> "cat" in view.html()
    True
    """
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise AttnkitTypeError(f"values must be a float tensor (B, R, L) from rollout, but got {short(values)}.")
    if values.dim() == 3:
        if not 0 <= batch < values.shape[0]:
            raise AttnkitValueError(f"batch={batch}, but values hold {values.shape[0]} sequences.")
        values = values[batch]
    elif values.dim() == 1:
        values = values[None]
    if values.dim() != 2:
        raise AttnkitValueError(f"values must be (B, R, L), (R, L) or (L,), but got {tuple(values.shape)}.")
    if not bool(torch.isfinite(values).all()):
        raise AttnkitValueError("values hold NaN or Inf: there is no relevance to draw.")
    length = values.shape[-1]
    labels = [str(i) for i in range(length)] if tokens is None else cut_labels(tokens)[0]
    if len(labels) != length:
        raise AttnkitValueError(f"got {len(labels)} tokens for {length} positions: pass one token per position.")
    names = [f"row {i}" for i in range(values.shape[0])] if rows is None else [str(r) for r in rows]
    if len(names) != values.shape[0]:
        raise AttnkitValueError(f"got {len(names)} row names for {values.shape[0]} rows.")
    return RelevanceView(values.detach().to("cpu", torch.float64), labels, names, printable(str(title)))
