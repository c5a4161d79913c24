"""The mask algebra: which keys each query may attend to.

One convention everywhere in attnkit: **True means "may attend"**, as in
``torch.nn.functional.scaled_dot_product_attention``.

A mask object describes a pattern without storing an ``Lq x Lk`` matrix. Combine
them with ``&`` (both allow) and ``|`` (either allows), hand them to
:func:`attnkit.attention`, turn them into the block lists kernels read with
:func:`attnkit.prepare`, or into a dense bool tensor with :meth:`Mask.materialize`.

Positions. Query ``i`` sits at key-axis position ``p(i) = i + q_offset`` plus
``Lk - Lq`` under ``align="bottom_right"`` (the default: a single decoding query
sees every cached key); key ``j`` sits at ``j + kv_offset``. Offsets are ints or
``(B,)`` tensors (one per sequence); they let a chunk of queries, a static cache or
a shard of a sequence keep the mask's structure.

Masks are values: a mask copies the tensors it is built from, so changing those
tensors afterwards does not change the mask.

Batch axes. A mask's shape is ``(B or 1, H or 1, Lq, Lk)`` and it broadcasts from the
right, like SDPA's ``attn_mask``: with inputs of several batch dimensions
``(B1, B2, H, L, D)``, a per-sequence mask (``padding(lengths)``, ``document(ids)``,
offsets of shape ``(B,)``) lines up with the innermost one, ``B2``.

>>> from attnkit import masks
>>> m = masks.causal() & masks.sliding_window(1)
>>> m
causal(align='bottom_right') & sliding_window(left=1, right=0, align='bottom_right')
>>> print(m.picture(4, 4))
1 0 0 0
1 1 0 0
0 1 1 0
0 0 1 1
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from attnkit._types import IntLike, Offset
from attnkit.masks._base import EMPTY, FULL, PARTIAL, Dense, Mask, as_mask
from attnkit.masks._from_fn import FromFn
from attnkit.masks._kinds import Cached, Causal, Document, Padding, PrefixLM, SlidingWindow
from attnkit.masks.blockmask import FromBlockMask

__all__ = [
    "Mask",
    "causal",
    "sliding_window",
    "prefix_lm",
    "document",
    "padding",
    "dense",
    "from_fn",
    "from_block_mask",
    "cached",
    "as_mask",
    "EMPTY",
    "PARTIAL",
    "FULL",
]


def cached(mask: Mask | None, start: torch.Tensor, lengths: torch.Tensor) -> Mask:
    """``mask`` for sequences stored left-aligned in a KV cache of varying fill.

    Query i of sequence b sits at key position ``start[b] + i`` (so a bottom-right
    aligned mask is aligned with each sequence's own end, and ``from_fn`` and document
    masks see ``start[b] + i`` as the query's index) and keys ``j >= lengths[b]`` are
    empty slots; top-left aligned masks keep the positions their offsets give, and a
    dense mask is for the call's ``(Lq, Lk)`` as given. :class:`attnkit.nn.KVCache`
    builds this for you. The inner mask keeps its block structure (a causal prefill
    into a cache skips the blocks above the diagonal).

    >>> print(cached(causal(), start=torch.tensor([1, 3]), lengths=torch.tensor([3, 5])).picture(2, 5, batch=0))
    1 1 0 0 0
    1 1 1 0 0
    """
    return Cached(mask, start, lengths)


def causal(align: str = "bottom_right", *, q_offset: Offset = 0, kv_offset: Offset = 0) -> Mask:
    """Query i may attend key j iff ``j + kv_offset <= p(i)``.

    ``p(i) = i + q_offset + (Lk - Lq)`` (``align="bottom_right"``, the default) or
    ``p(i) = i + q_offset`` (``align="top_left"``). With Lq == Lk both are the lower
    triangle:

    >>> print(causal().picture(3, 5))
    1 1 1 0 0
    1 1 1 1 0
    1 1 1 1 1
    >>> print(causal(align="top_left").picture(3, 5))
    1 0 0 0 0
    1 1 0 0 0
    1 1 1 0 0

    A chunk of 2 queries at positions 3 and 4 of a static cache of 6 slots:

    >>> print(causal(align="top_left", q_offset=3).picture(2, 6))
    1 1 1 1 0 0
    1 1 1 1 1 0
    """
    return Causal(align, q_offset, kv_offset)


def sliding_window(
    left: int, right: int = 0, align: str = "bottom_right", *, q_offset: Offset = 0, kv_offset: Offset = 0
) -> Mask:
    """Query i may attend key j iff ``p(i) - left <= j + kv_offset <= p(i) + right``.

    >>> print(sliding_window(1, 1).picture(4, 4))
    1 1 0 0
    1 1 1 0
    0 1 1 1
    0 0 1 1
    """
    return SlidingWindow(left, right, align, q_offset, kv_offset)


def prefix_lm(prefix_len: IntLike, align: str = "bottom_right", *, q_offset: Offset = 0, kv_offset: Offset = 0) -> Mask:
    """Query i may attend key j iff ``j' < prefix_len`` or ``j' <= p(i)``, with ``j' = j + kv_offset``.

    ``prefix_len`` is an int or a tensor of shape ``(B,)`` (one prefix per sequence).

    >>> print(prefix_lm(2).picture(4, 4))
    1 1 0 0
    1 1 0 0
    1 1 1 0
    1 1 1 1
    """
    return PrefixLM(prefix_len, align, q_offset, kv_offset)


def document(ids: torch.Tensor, *, q_offset: Offset = 0, kv_offset: Offset = 0) -> Mask:
    """Query i may attend key j iff ``ids[i + q_offset] == ids[j + kv_offset]`` (packed sequences).

    ``ids`` has shape ``(L,)`` or ``(B, L)``. Without offsets it is for self-attention
    over the packed sequence (Lq == Lk == L); with offsets, for a part of it (a chunk
    of queries, a shard of the keys). Combine with :func:`causal` for packed causal
    language modelling.

    >>> print(document([0, 0, 1, 1, 1]).picture(5, 5))
    1 1 0 0 0
    1 1 0 0 0
    0 0 1 1 1
    0 0 1 1 1
    0 0 1 1 1
    """
    return Document(ids, q_offset, kv_offset)


def padding(lengths: torch.Tensor | Sequence[int], *, kv_offset: Offset = 0) -> Mask:
    """Query i of sequence b may attend key j iff ``j + kv_offset < lengths[b]``.

    ``lengths`` has shape ``(B,)``; keys past a sequence's length are padding. Kernels
    never read them, so anything stored there (NaN included) cannot reach the output.

    >>> print(padding([2, 3]).picture(2, 4, batch=0))
    1 1 0 0
    1 1 0 0
    """
    return Padding(lengths, kv_offset)


def dense(tensor: torch.Tensor) -> Mask:
    """Wrap a bool tensor broadcastable to ``(B, H, Lq, Lk)``, aligned from the right.

    As for ``scaled_dot_product_attention``'s ``attn_mask``: ``(Lq, Lk)`` is the same
    for every sequence and head, ``(H, Lq, Lk)`` is per head, ``(B, 1, Lq, Lk)`` per
    sequence; sizes of 1 broadcast. The mask holds a copy of the tensor (masks are
    values: editing the tensor afterwards does not change the mask); broadcast
    dimensions of an ``expand``-ed tensor are not materialised.

    >>> import torch
    >>> m = dense(torch.tensor([[True, False], [True, True]])) & causal()
    >>> print(m.picture(2, 2))
    1 0
    1 1
    """
    return Dense(tensor)


def from_fn(
    fn: Callable[..., torch.Tensor],
    *,
    batch_size: int | None = None,
    num_heads: int | None = None,
    q_offset: Offset = 0,
    kv_offset: Offset = 0,
) -> Mask:
    """A mask given by a predicate ``fn(b, h, q_idx, kv_idx) -> bool tensor``.

    The arguments are broadcasting index tensors of shapes ``(B, 1, 1, 1)``,
    ``(1, H, 1, 1)``, ``(1, 1, tq, 1)`` and ``(1, 1, 1, tk)`` (as FlexAttention's
    ``mask_mod``); ``b`` and ``h`` are 0 unless ``batch_size`` / ``num_heads`` say the
    mask differs by sequence / head. ``q_idx`` and ``kv_idx`` include the offsets.
    Block maps evaluate ``fn`` one row of blocks at a time (``O(block x Lk)`` memory).

    >>> m = from_fn(lambda b, h, q, kv: (q - kv).abs() <= 1)
    >>> print(m.picture(4, 4))
    1 1 0 0
    1 1 1 0
    0 1 1 1
    0 0 1 1
    """
    return FromFn(fn, batch_size, num_heads, q_offset, kv_offset)


def from_block_mask(block_mask: Any) -> Mask:
    """FlexAttention's ``BlockMask`` (made by ``torch.nn.attention.flex_attention.create_block_mask``,
    ``BlockMask.from_kv_blocks`` or :func:`attnkit.flex.create_block_mask`) as a mask: its block map
    is kept as it is (full blocks are full, unlisted blocks empty) and its ``mask_mod`` is asked only
    for the pairs of its partial blocks, as FlexAttention does. Any ``BLOCK_SIZE``.

    >>> import torch
    >>> from torch.nn.attention.flex_attention import create_block_mask
    >>> bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 4, 4, device="cpu", BLOCK_SIZE=2)
    >>> print(from_block_mask(bm).picture(4, 4))
    1 0 0 0
    1 1 0 0
    1 1 1 0
    1 1 1 1
    """
    return FromBlockMask(block_mask)
