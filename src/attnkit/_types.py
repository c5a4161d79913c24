"""Type aliases of the public API's annotations (for readers, mypy and the API docs)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Union

import numpy as np
import torch

if TYPE_CHECKING:
    from attnkit.bias import Bias
    from attnkit.masks import Mask
    from attnkit.prepare import PreparedMask
    from attnkit.score_mods import ScoreMod

__all__ = ["ArrayLike", "BiasLike", "Device", "Index", "IntLike", "MaskLike", "Offset", "PathLike", "ScoreModLike"]

#: Where a tensor lives: a ``torch.device``, its name (``"cpu"``, ``"cuda:0"``) or None (the default).
Device = Union[torch.device, str, None]
#: An offset or length: a Python int, or an int64 tensor of one value per sequence.
Offset = Union[int, torch.Tensor]
#: A count or size given as an int or a 0-d/1-d integer tensor.
IntLike = Union[int, torch.Tensor]
#: What ``mask=`` takes: a mask object, a prepared mask, a bool or float tensor, or None.
MaskLike = Union["Mask", "PreparedMask", torch.Tensor, None]
#: What ``attn_bias=`` takes: an :mod:`attnkit.bias` object, a float tensor, or None.
BiasLike = Union["Bias", torch.Tensor, None]
#: What ``score_mod=`` takes: ``fn(score, b, h, q_idx, kv_idx) -> score``, a ScoreMod, or None.
ScoreModLike = Union["ScoreMod", Callable[..., torch.Tensor], None]
#: A selection of rows or heads: an int, a slice, a sequence of ints, a 1-D integer tensor or None (all).
Index = Union[int, slice, Sequence[int], torch.Tensor, None]
#: A file or folder: a string or an ``os.PathLike`` (``pathlib.Path``).
PathLike = Union[str, "os.PathLike[str]"]
#: Numbers to draw: a tensor (any device, detached for drawing) or a NumPy array.
ArrayLike = Union[torch.Tensor, np.ndarray]
