"""Type aliases of the public API's annotations (for readers, mypy and the API docs) that name no
attnkit class; ``MaskLike``, ``BiasLike`` and ``ScoreModLike`` live beside their classes
(prepare.py, bias.py, score_mods.py), so this module imports none of them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Union

import numpy as np
import torch

__all__ = ["ArrayLike", "Device", "Index", "IntLike", "Offset", "PathLike"]

#: Where a tensor lives: a ``torch.device``, its name (``"cpu"``, ``"cuda:0"``) or None (the default).
Device = Union[torch.device, str, None]
#: An offset or length: a Python int, or an int64 tensor of one value per sequence.
Offset = Union[int, torch.Tensor]
#: A count or size given as an int or a 0-d/1-d integer tensor.
IntLike = Union[int, torch.Tensor]
#: A selection of rows or heads: an int, a slice, a sequence of ints, a 1-D integer tensor or None (all).
Index = Union[int, slice, Sequence[int], torch.Tensor, None]
#: A file or folder: a string or an ``os.PathLike`` (``pathlib.Path``).
PathLike = Union[str, "os.PathLike[str]"]
#: Numbers to draw: a tensor (any device, detached for drawing) or a NumPy array.
ArrayLike = Union[torch.Tensor, np.ndarray]
