"""Fonts for token labels: matplotlib's default font has no CJK glyphs."""

from __future__ import annotations

import functools
from importlib import resources

# Families that cover CJK, tried in order; the first found on the system is used.
_CJK_FAMILIES = (
    "Noto Sans CJK SC",
    "Noto Sans CJK JP",
    "Source Han Sans SC",
    "WenQuanYi Zen Hei",
    "WenQuanYi Micro Hei",
    "SimHei",
    "Microsoft YaHei",
    "PingFang SC",
)


@functools.cache
def font_families() -> tuple[str, ...]:
    """Font family list for labels: DejaVu Sans first, then a CJK fallback if one exists.

    The ``viz`` extra installs ``mplfonts``, whose Noto Sans CJK SC is registered
    here when no system CJK font is found.
    """
    from matplotlib import font_manager

    installed = {f.name for f in font_manager.fontManager.ttflist}
    for family in _CJK_FAMILIES:
        if family in installed:
            return ("DejaVu Sans", family)
    try:
        path = resources.files("mplfonts") / "fonts" / "NotoSansCJKsc-Regular.otf"
    except ModuleNotFoundError:
        return ("DejaVu Sans",)
    if not path.is_file():
        return ("DejaVu Sans",)
    font_manager.fontManager.addfont(str(path))
    return ("DejaVu Sans", font_manager.FontProperties(fname=str(path)).get_name())


@functools.cache
def cjk_font_path():
    """A font file that covers CJK (the packaged Noto Sans CJK SC first), or None."""
    try:
        path = resources.files("mplfonts") / "fonts" / "NotoSansCJKsc-Regular.otf"
        if path.is_file():
            return str(path)
    except ModuleNotFoundError:
        pass
    try:
        from matplotlib import font_manager
    except ModuleNotFoundError:  # HTML views without the viz extra: no CJK font to embed
        return None

    for family in _CJK_FAMILIES:
        found = font_manager.findfont(family, fallback_to_default=False) if _has(family) else None
        if found:
            return found
    return None


def _has(family: str) -> bool:
    from matplotlib import font_manager

    return any(f.name == family for f in font_manager.fontManager.ttflist)


def glyph_subset(text: str) -> bytes | None:
    """An OpenType font holding only the glyphs of ``text`` that are not ASCII (None if none).

    Pages embed it so that they show their CJK tokens on machines without CJK fonts.
    """
    chars = "".join(sorted({ch for ch in text if ord(ch) > 0x7E and not ch.isspace()}))
    path = cjk_font_path()
    if not chars or path is None:
        return None
    import io

    from fontTools import subset
    from fontTools.ttLib import TTFont

    options = subset.Options()
    options.layout_features, options.name_IDs, options.hinting = [], [1, 2], False
    font = TTFont(path, lazy=True)
    subsetter = subset.Subsetter(options)
    subsetter.populate(text=chars)
    subsetter.subset(font)
    buffer = io.BytesIO()
    font.save(buffer)
    return buffer.getvalue()


@functools.cache
def _covered() -> frozenset[int]:
    """The code points some family of :func:`font_families` draws."""
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    points: set[int] = set()
    for family in font_families():
        path = font_manager.findfont(family, fallback_to_default=False) if _has(family) else None
        if path is not None:
            points.update(FT2Font(path).get_charmap())
    return frozenset(points)


#: Drawn for a character no label font has (an emoji): DejaVu Sans's replacement character.
MISSING = "\ufffd"


def drawable(text: str) -> str:
    """``text`` with every character the label fonts cannot draw (emoji, rare scripts) replaced by
    U+FFFD, so that figures show a visible mark instead of an empty box and matplotlib prints no
    "Glyph missing" warning (the pages, which embed fonts and fall back to the browser's, keep them)."""
    covered = _covered()
    if not covered or all(ord(c) in covered or c in "\n\t " for c in text):
        return text
    return "".join(c if ord(c) in covered or c in "\n\t " else MISSING for c in text)
