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


@functools.lru_cache(maxsize=None)
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
