"""Score biases: how much each (query, key) pair counts, beside masks (which pairs count).

A bias is added to the scaled (and soft-capped) score of every kept pair::

    s = q . k * scale
    s = softcap * tanh(s / softcap)          if softcap is given
    s = s + attn_bias(b, h, i, j)

- :func:`alibi`: ``-slope[h] * |p(i) - j|`` (ALiBi; ``causal=True``: ``-slope[h] * (p(i) - j)``);
  :func:`alibi_slopes` gives the published geometric slopes;
- :func:`relative`: T5's bucketed relative position bias from a learnable table;
- :func:`from_fn`: any ``fn(b, h, q_idx, kv_idx) -> float tensor``;
- :func:`dense`: a float tensor broadcastable to ``(B, Hq, Lq, Lk)``;
- sums of these with ``+``.

Biases are evaluated one tile at a time by the block-sparse kernel (never as an
``Lq x Lk`` tensor) and are differentiable: gradients reach the slopes, tables,
dense tensors and the tensors passed to :func:`from_fn`. Unlike masks, a bias holds
*references* to its tensors (they are parameters being learned), not copies.

Positions follow the masks' rules: with ``align="bottom_right"`` (the default) the
last query sits at the last key (decoding), ``q_offset``/``kv_offset`` (int or
``(B,)``) shift the query and key positions.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch

from attnkit._types import Offset
from attnkit._validate import AttnkitTypeError, AttnkitValueError, short
from attnkit.bias._base import Bias
from attnkit.bias._kinds import Alibi, Dense, FromFn, Relative, relative_buckets

__all__ = [
    "Alibi",
    "Bias",
    "BiasLike",
    "alibi",
    "alibi_slopes",
    "band_of",
    "cached",
    "dense",
    "from_fn",
    "relative",
    "relative_buckets",
]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The published ALiBi slopes ``(num_heads,)``: a geometric sequence from ``2^(-8/n)``.

    For a power of two ``n`` the slopes are ``2^(-8/n)``, ``2^(-16/n)``, ... For
    other ``n``, the slopes of the nearest lower power of two ``m`` followed by every
    other slope of ``2m`` (as in the BLOOM and ALiBi code).

    >>> alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, numbers.Integral) or num_heads <= 0:
        raise AttnkitValueError(f"num_heads must be a positive int, but got {short(num_heads)}.")

    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    m = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = powers(m)
    if m < num_heads:
        slopes += powers(2 * m)[0::2][: num_heads - m]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi(
    slopes: torch.Tensor,
    *,
    causal: bool = False,
    align: str = "bottom_right",
    q_offset: Offset = 0,
    kv_offset: Offset = 0,
) -> Bias:
    """ALiBi: ``-slopes[h] * |p(i) - j|``, a penalty linear in the distance.

    ``slopes: (Hq,)`` float tensor (it may require grad); :func:`alibi_slopes` gives
    the published ones. ``causal=True`` uses ``-slopes[h] * (p(i) - j)``, the form of
    decoder models (equal to the symmetric one on every pair a causal mask keeps,
    and, up to a constant per row, to BLOOM's ``slopes[h] * j``).
    """
    return Alibi(slopes, causal, align, q_offset, kv_offset)


def relative(
    table: torch.Tensor,
    num_buckets: int = 32,
    max_distance: int = 128,
    bidirectional: bool = True,
    *,
    align: str = "bottom_right",
    q_offset: Offset = 0,
    kv_offset: Offset = 0,
) -> Bias:
    """T5's relative position bias: ``table[bucket(j - p(i)), h]``.

    ``table: (num_buckets, Hq)`` float tensor, learnable (T5's
    ``relative_attention_bias.weight``); :func:`relative_buckets` is the bucket
    function. ``bidirectional=False`` for decoders (keys after the query share
    bucket 0).
    """
    return Relative(table, num_buckets, max_distance, bidirectional, align, q_offset, kv_offset)


def from_fn(
    fn: Callable[..., torch.Tensor], *params: torch.Tensor, q_offset: Offset = 0, kv_offset: Offset = 0
) -> Bias:
    """Any bias ``fn(b, h, q_idx, kv_idx) -> float tensor``, evaluated one tile at a time.

    The arguments are broadcasting int64 index tensors ``b: (Bs, 1, 1, 1)``,
    ``h: (1, Hs, 1, 1)``, ``q_idx: (1, 1, n, 1)`` (plus ``q_offset``) and
    ``kv_idx: (1, 1, 1, S)`` (plus ``kv_offset``); the result must broadcast to
    ``(Bs, Hs, n, S)``. Pass the tensors ``fn`` closes over as ``params`` for their
    gradients to flow (``fn`` is recomputed tile by tile in the backward pass).

    >>> import torch
    >>> scale = torch.tensor(0.5, requires_grad=True)
    >>> distance = from_fn(lambda b, h, i, j: -scale * (i - j).abs(), scale)
    """
    return FromFn(fn, params, q_offset, kv_offset)


def cached(bias: Bias, start: torch.Tensor) -> Bias:
    """``bias`` for queries stored in a KV cache after ``start[b]`` entries of sequence b.

    Query i of sequence b sits at key position ``start[b] + i``, as in
    :func:`attnkit.masks.cached`: bottom-right aligned biases (ALiBi, relative) measure
    distances from each sequence's own end, and :func:`from_fn` sees ``start[b] + i`` as
    the query's index; top-left aligned biases keep the positions their offsets give, and
    a dense bias is for the call's ``(Lq, Lk)`` as given. ``start: (B,)`` integers.
    :class:`attnkit.nn.KVCache` (``cache.bias(b)``) and
    :class:`~attnkit.MultiHeadAttention` with ``cache=`` apply it for you.
    """
    if not isinstance(bias, Bias):
        raise AttnkitTypeError(f"cached() takes an attnkit.bias object, but got {type(bias).__name__}.")
    from attnkit._validate import check_int_tensor

    return bias._in_cache(check_int_tensor(start, "start", (1,)).detach().clone())


def dense(tensor: torch.Tensor) -> Bias:
    """A float tensor broadcastable to ``(B, Hq, Lq, Lk)``, added to the scores (with gradient).

    This is what an additive float mask is, as a bias: the block-sparse kernel reads
    only the tiles it visits, and masks still decide which pairs count.
    """
    return Dense(tensor)


#: What ``attn_bias=`` takes: an :mod:`attnkit.bias` object, a float tensor, or None.
BiasLike = Bias | torch.Tensor | None


def band_of(bias: Bias | None, q: torch.Tensor, k: torch.Tensor, check: bool = True) -> torch.Tensor | None:
    """``bias`` as one band of ``kv - q`` per head (:meth:`attnkit.bias.Bias.band`) for 4-D ``q, k``:
    ``(Hq or 1, Lq + Lk - 1)`` in float32 (float64 for float64 inputs) on the CPU, differentiable in
    the bias's tensors; None without a bias, off the CPU, for a bias that is not a band, or (with
    ``check``: one host read of the band) one holding a value that is not finite (a row could then
    see no finite score, which the engines that add a band do not answer with 0)."""
    if bias is None or q.device.type != "cpu":
        return None
    values = bias.band(q.shape[1], q.shape[2], k.shape[2])
    if values is None:
        return None
    values = values.to(device=q.device, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    values = values.contiguous()
    if check and not bool(torch.isfinite(values.detach()).all()):
        return None
    return values
