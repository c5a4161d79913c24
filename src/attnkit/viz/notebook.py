"""Views inside a notebook: attnkit's self-contained pages in an output cell.

An object's ``_repr_html_`` (Jupyter's display protocol) returns its page inside an ``<iframe
srcdoc>``: the page keeps its own scripts, styles and embedded glyphs, apart from the notebook's,
and nothing is fetched. :data:`INLINE_BUDGET` bounds what one cell may hold; a view that would
exceed it says so and how to get a smaller one.
"""

from __future__ import annotations

import html

__all__ = ["INLINE_BUDGET", "LONG_BUDGET", "iframe", "too_big"]

#: Bytes an inline view of short inputs may take (e.g. 512 tokens x 6 layers x 12 heads of statistics).
INLINE_BUDGET = 2 * 2**20
#: Bytes an inline long-context view may take (32k tokens).
LONG_BUDGET = 10 * 2**20


def iframe(page: str, height: int = 640, title: str = "attnkit view") -> str:
    """``page`` (a whole HTML document) as an ``<iframe srcdoc>`` sized for a notebook cell; scripts
    run inside it only (``sandbox="allow-scripts"``)."""
    return (
        f'<iframe class="attnkit-view" title="{html.escape(title)}" sandbox="allow-scripts" '
        f'style="width:100%;height:{int(height)}px;border:1px solid #ddd" '
        f'srcdoc="{html.escape(page, quote=True)}"></iframe>'
    )


def too_big(what: str, size: int, budget: int, hint: str) -> str:
    """A short note in place of a view over its budget."""
    return (
        f'<div class="attnkit-view-note"><b>attnkit</b>: the {html.escape(what)} view would take '
        f"{size / 2**20:.1f} MB (a notebook cell holds up to {budget / 2**20:.0f} MB here). "
        f"{html.escape(hint)}</div>"
    )
