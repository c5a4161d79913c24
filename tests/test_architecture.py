"""The kernel contract as the architecture page describes it: kernels read the prepared
plan's facts (never a mask's class), the registry is a priority list that a new kernel
joins with one call, and a mask is prepared once per (mask, lengths, block size, device)."""

from __future__ import annotations

import re
from pathlib import Path

import attnkit

SRC = Path(attnkit.__file__).parent


def _sources():
    return {p.relative_to(SRC).as_posix(): p.read_text(encoding="utf-8") for p in SRC.rglob("*.py")}


def test_no_module_reaches_into_a_masks_private_names():
    """Mask structure is published (band, limit_only, positions, elements, block_codes, key_limit,
    tensors); only masks.py and prepare.py touch what is private to masks."""
    private = re.compile(
        r"masks\._[A-Za-z]|\._(block_map|dense|held|kv_limit|shift|q_pos|k_pos|position_key|"
        r"position_value|index_shift)\(|\bmask\._(key|part|in_cache)\("
    )
    offenders = [
        f"{name}:{i + 1}: {line.strip()}"
        for name, text in _sources().items()
        if name not in ("masks.py", "prepare.py")
        for i, line in enumerate(text.splitlines())
        if private.search(line)
    ]  # (biases have a _part and _in_cache of their own, in bias.py)
    assert not offenders, "\n".join(offenders)


def test_no_kernel_module_uses_another_modules_private_names():
    modules = ("tiled", "tiles", "lse", "sdpa", "reference", "registry", "triton_attention")
    pattern = re.compile(
        r"\b(?:_?(?:"
        + "|".join(modules)
        + r"))\._[a-z]\w*|from attnkit\.kernels\.(?:"
        + "|".join(modules)
        + r") import [^\n]*\b_[a-z]"
    )
    offenders = [
        f"{name}:{i + 1}: {line.strip()}"
        for name, text in _sources().items()
        for i, line in enumerate(text.splitlines())
        if pattern.search(line)
    ]
    assert not offenders, "\n".join(offenders)


# --- a toy kernel joins with one register_kernel call ------------------------------------------


# --- preparations --------------------------------------------------------------------------------
