"""An index page for a folder of attnkit outputs: ``python -m attnkit.viz.gallery attention``.

Lists every HTML view and shows every PNG the folder (and its subfolders) holds, so
``make demo``'s outputs open from one page.
"""

from __future__ import annotations

import html
import sys
from pathlib import Path

from attnkit._types import PathLike

TITLES = {
    "attention.html": "MiniLM: every layer and head (attnkit show)",
    "alignment.html": "DateTranslator: cross-attention alignment (attnkit translate)",
    "caption.html": "DigitCaptioner: where each word looked (attnkit caption)",
    "recommend.html": "SASRec: which past movies the recommendation attended to (attnkit recommend)",
    "listen.html": "SpeechRecognizer: which stretch of audio each digit was read from (attnkit listen)",
    "long.html": "RecallLM over a long text: statistics of every head, key mass, the question's weights "
    "(attnkit show --model recall)",
}


def write_gallery(folder: PathLike) -> Path:
    """Write ``folder/index.html`` linking the views and showing the figures found under ``folder``."""
    root = Path(folder)
    pages = sorted(p for p in root.rglob("*.html") if p.name != "index.html")
    figures = sorted(root.rglob("*.png"))
    items = [
        f'<li><a href="{html.escape(p.relative_to(root).as_posix())}">'
        f"{html.escape(TITLES.get(p.name, p.relative_to(root).as_posix()))}</a></li>"
        for p in pages
    ]
    images = [
        f'<figure><img src="{html.escape(p.relative_to(root).as_posix())}" alt="">'
        f"<figcaption>{html.escape(p.relative_to(root).as_posix())}</figcaption></figure>"
        for p in figures
    ]
    page = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>attnkit demo</title>'
        "<style>body{font:14px system-ui,sans-serif;margin:24px;color:#222}img{max-width:640px;border:1px solid #ddd}"
        "figure{display:inline-block;margin:8px;vertical-align:top}</style></head><body>"
        "<h1>attnkit demo</h1><h2>Interactive views</h2><ul>" + "".join(items) + "</ul>"
        "<h2>Figures</h2>" + "".join(images) + "</body></html>"
    )
    path = root / "index.html"
    path.write_text(page, encoding="utf-8")
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m attnkit.viz.gallery FOLDER")
    print(f"wrote {write_gallery(sys.argv[1])}")
