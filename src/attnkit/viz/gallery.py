"""An index page for a folder of attnkit outputs: ``python -m attnkit.viz.gallery attention``.

One section per application (what it is, the command that made it, its interactive view),
each figure with a caption saying what to look at; a figure opens at full size on a click.
Files the page does not know are listed at the end under their own names, so ``make
demo``'s outputs (and anything else written into the folder) open from one page.
"""

from __future__ import annotations

import html
import sys
from pathlib import Path

from attnkit._types import PathLike

#: (heading, what it is, the command, {file name: caption}); a page's caption is its link text.
SECTIONS = [
    (
        "Reading a sentence: all-MiniLM-L6-v2",
        "Self-attention of a real sentence-embedding model rebuilt from attnkit's parts.",
        "attnkit show TEXT",
        {
            "attention.html": "open the interactive view: every layer and head, lines between tokens, heatmaps",
            "attention_heads.png": "three heads that each do one recognisable thing, chosen by their numbers: "
            "one reads the previous token (the bright line just below the diagonal), one rests on [CLS] or [SEP] "
            "(a bright first or last column: nothing to do at this token), one spreads over the whole text.",
            "attention.png": "every layer (rows) x head (columns) at a glance, the same kinds of pattern in each; "
            "click to open it at full size, or open the interactive view above.",
        },
    ),
    (
        "Translating a date: DateTranslator",
        "An encoder-decoder writing any date as YYYY-MM-DD; its cross-attention is the alignment.",
        'attnkit translate "25th of March 2019"',
        {
            "alignment.html": "open the alignment (last layer, mean of heads), with every layer and head a click away",
            "alignment.png": "each output character (row) and the input characters it read (columns): the year "
            "digits sit on the year, 03 on 'March', 25 on '25th'.",
            "alignment_grid.png": "the same for every decoder layer (rows) and head (columns): some heads align, "
            "others spread out.",
        },
    ),
    (
        "Captioning handwritten digits: DigitCaptioner",
        "Attention over image regions: each word of the caption looks at one part of the strip.",
        "attnkit caption --digits 7,3,1",
        {
            "caption.html": "open the caption: hover a word to see the region it looked at",
            "caption.png": "each word's cross-attention over the image: the outlined patch should sit on the digit "
            "the word names, left to right.",
        },
    ),
    (
        "Recommending movies: SASRec on MovieLens-100K",
        "Self-attention over a user's history: which past movies a recommendation draws on.",
        "attnkit recommend --user 1",
        {
            "recommend.html": "open the recommendations: the top 10 titles, each with the past movies it drew on most",
            "recommend.png": "the next-item query's attention over the last 30 movies (oldest left), per layer: "
            "recent movies usually weigh most.",
        },
    ),
    (
        "A long text: RecallLM on 16,384 tokens",
        "Exact statistics of every head without the L x L matrix, and the question's own weights.",
        "attnkit show --model recall --length 16384",
        {
            "long.html": "open the long view: per-head statistics, the mass each token receives, zoom to tokens",
            "long_heads.png": "per layer and head: mean entropy (bits), mass on the first token, mean distance "
            "looked back (means over all queries).",
            "long_keymass.png": "how much attention each token receives, summed over the queries (the causal mask "
            "lets more queries see early tokens, so the curve falls); the dashed line marks the needle, the "
            "key-value pair the question asks for.",
            "long_rows.png": "the question token's weights over all 16k tokens, per layer and head: the peak on "
            "the dashed line (the needle) is the model recalling the pair.",
        },
    ),
    (
        "Hearing spoken digits: SpeechRecognizer",
        "Cross-attention aligning audio frames and characters, on a voice never heard in training.",
        "attnkit listen --example 1",
        {
            "listen.html": "open the transcript: each character shaded over the stretch of audio it was read from",
            "listen.png": "waveform, spectrogram and each character's attention on one time axis: each digit's "
            "bright band (white dot: its peak) should sit over the sound of its word, in order.",
        },
    ),
]


def _caption_for(name: str) -> tuple[int, str] | None:
    """(section index, caption) for a file name, or None."""
    for i, (_, _, _, files) in enumerate(SECTIONS):
        if name in files:
            return i, files[name]
        if name.startswith("attention_layer") and i == 0:
            return 0, "one head drawn with its token labels (attnkit show --layer/--head)"
    return None


def write_gallery(folder: PathLike) -> Path:
    """Write ``folder/index.html``: one section per application found under ``folder``."""
    root = Path(folder)
    files = sorted(
        (p for p in root.rglob("*") if p.suffix in (".html", ".png") and p.name != "index.html"),
        key=lambda p: (p.suffix != ".html", p.as_posix()),
    )
    found: dict[int, list[str]] = {}
    other = []
    order = {name: n for _, _, _, names in SECTIONS for n, name in enumerate(names)}
    files.sort(key=lambda p: (p.suffix != ".html", order.get(p.name, len(order)), p.as_posix()))
    for path in files:
        link = html.escape(path.relative_to(root).as_posix())
        known = _caption_for(path.name)
        if known is None:
            other.append(f'<li><a href="{link}">{link}</a></li>')
            continue
        section, caption = known
        if path.suffix == ".html":
            item = f'<p class="view"><a href="{link}">{html.escape(caption)}</a> <span>({link})</span></p>'
        else:
            item = (
                f'<figure><a href="{link}" title="open at full size"><img src="{link}" alt="{html.escape(caption)}">'
                f"</a><figcaption>{html.escape(caption)} <span>({link})</span></figcaption></figure>"
            )
        found.setdefault(section, []).append(item)
    parts = []
    for i, items in sorted(found.items()):
        heading, what, command, _ = SECTIONS[i]
        parts.append(
            f"<section><h2>{html.escape(heading)}</h2><p>{html.escape(what)} <code>{html.escape(command)}</code></p>"
            + "".join(items)
            + "</section>"
        )
    if other:
        parts.append("<section><h2>Other files</h2><ul>" + "".join(other) + "</ul></section>")
    page = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>attnkit demo</title>'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<style>body{font:15px system-ui,sans-serif;margin:24px auto;max-width:1100px;padding:0 16px;color:#222}"
        "section{border-top:1px solid #ddd;padding:8px 0 16px}h2{font-size:19px;margin:10px 0 4px}"
        "code{background:#f2f2f2;padding:1px 5px;border-radius:3px}.view{font-size:16px}"
        "figure{margin:12px 0}img{max-width:100%;border:1px solid #ddd;display:block}"
        "figcaption{color:#444;margin-top:4px;max-width:860px}span{color:#888;font-size:12px}</style></head><body>"
        "<h1>attnkit demo</h1><p>What <code>make demo</code> wrote: one section per application. Each "
        "section's first link opens its interactive view (self-contained, works offline); click a figure "
        "to open it at full size.</p>" + "".join(parts) + "</body></html>"
    )
    path = root / "index.html"
    path.write_text(page, encoding="utf-8")
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m attnkit.viz.gallery FOLDER")
    index = write_gallery(sys.argv[1])
    print(f"wrote {index}")
    print(f"open it in a browser: {index.resolve().as_uri()}")
