"""attnkit: exact attention for any mask, attention you can see into, and the
tutorial's API on top.

One mask convention everywhere: True means "may attend".

The names below are loaded when first used (``import attnkit`` imports neither torch
nor anything else until then), so the ``attnkit`` command answers ``--help`` at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from attnkit.errors import AttnkitError, AttnkitTypeError, AttnkitValueError, MissingExtraError

try:  # the one version source is pyproject.toml, through the installed package's metadata
    from importlib.metadata import PackageNotFoundError as _NotFound
    from importlib.metadata import version as _version

    __version__ = _version("attnkit")
except _NotFound:  # pragma: no cover - a source tree on sys.path, not installed
    __version__ = "0+unknown"

#: name -> (module, attribute); the tutorial's functions are the same objects as attnkit.tutorial's.
_NAMES = {
    "attention": ("attnkit.functional", "attention"),
    "attention_weights": ("attnkit.functional", "attention_weights"),
    "attention_with_weights": ("attnkit.functional", "attention_with_weights"),
    "explain": ("attnkit.functional", "explain"),
    "capture": ("attnkit.inspect", "capture"),
    "use_kernels": ("attnkit.kernels", "use_kernels"),
    "KVCache": ("attnkit.nn", "KVCache"),
    "MultiHeadAttention": ("attnkit.nn", "MultiHeadAttention"),
    "PreparedMask": ("attnkit.plan", "PreparedMask"),
    "prepare": ("attnkit.plan", "prepare"),
    "create_causal_mask": ("attnkit.tutorial", "create_causal_mask"),
    "create_padding_mask": ("attnkit.tutorial", "create_padding_mask"),
    "scaled_dot_product_attention": ("attnkit.tutorial", "scaled_dot_product_attention"),
    "visualize_attention": ("attnkit.tutorial", "visualize_attention"),
}
_SUBMODULES = {
    "bias",
    "call",
    "distributed",
    "functional",
    "inspect",
    "integrations",
    "kernels",
    "masks",
    "models",
    "nn",
    "plan",
    "score_mods",
    "tutorial",
    "viz",
}

__all__ = [
    "AttnkitError",
    "AttnkitTypeError",
    "AttnkitValueError",
    "KVCache",
    "MissingExtraError",
    "MultiHeadAttention",
    "PreparedMask",
    "attention",
    "attention_weights",
    "attention_with_weights",
    "capture",
    "create_causal_mask",
    "create_padding_mask",
    "explain",
    "masks",
    "prepare",
    "scaled_dot_product_attention",
    "tutorial",
    "use_kernels",
    "visualize_attention",
]


def __getattr__(name: str):
    if name in _NAMES:
        module, attribute = _NAMES[name]
        value = getattr(importlib.import_module(module), attribute)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"attnkit.{name}")
    else:
        raise AttributeError(f"module 'attnkit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES) | _SUBMODULES)


if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from attnkit import bias as bias
    from attnkit import call as call
    from attnkit import distributed as distributed
    from attnkit import functional as functional
    from attnkit import inspect as inspect
    from attnkit import integrations as integrations
    from attnkit import kernels as kernels
    from attnkit import masks as masks
    from attnkit import nn as nn
    from attnkit import plan as plan
    from attnkit import score_mods as score_mods
    from attnkit import tutorial as tutorial
    from attnkit.functional import attention, attention_weights, attention_with_weights, explain
    from attnkit.inspect.capturing import capture
    from attnkit.kernels import use_kernels
    from attnkit.nn import KVCache, MultiHeadAttention
    from attnkit.plan import PreparedMask, prepare
    from attnkit.tutorial import (
        create_causal_mask,
        create_padding_mask,
        scaled_dot_product_attention,
        visualize_attention,
    )
