"""A torch ``BlockMask`` (FlexAttention's) made from a block map: the lists torch's kernels read
(partial blocks in ``kv_indices``, full ones in ``full_kv_indices``) and a ``mask_mod`` for the
partial blocks. Below the masks (it reads block codes and asks a mask's ``elements``), so
``Mask.to_block_mask`` makes one without reaching up."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from attnkit._indexing import as4d
from attnkit.masks._codes import EMPTY, FULL, PARTIAL

__all__ = ["PlannedBlockMask", "mask_mod_of", "planned", "planned_block_mask", "to_block_mask", "to_torch_block_mask"]


def to_torch_block_mask(
    codes: torch.Tensor, block_size, q_len: int, kv_len: int, mask_mod=None, *, separate_full_blocks: bool = True
):
    """A torch ``BlockMask`` of the block map ``codes (B, H, nq, nk)`` at ``block_size``: its partial
    blocks as ``kv_indices``, its full ones as ``full_kv_indices`` (with ``separate_full_blocks=False``
    every kept block is listed as partial and there are no full lists, as torch's
    ``create_block_mask`` makes them), with ``mask_mod`` for the partial blocks (what torch's
    ``flex_attention`` evaluates there)."""
    return _block_mask_of(BlockMask, codes, block_size, q_len, kv_len, mask_mod, separate_full_blocks)


def _block_mask_of(cls, codes, block_size, q_len, kv_len, mask_mod, separate_full_blocks):
    kv_lists, q_lists = [], []
    wanted = (PARTIAL, FULL) if separate_full_blocks else ((PARTIAL, FULL),)
    for code in wanted:
        hit = codes == code if isinstance(code, int) else codes != EMPTY
        kv_lists += _listed(hit)
        q_lists += _listed(hit.transpose(-2, -1))  # the same blocks by key block (what the backward reads)
    if not separate_full_blocks:
        kv_lists += [None, None]
        q_lists += [None, None]
    bq, bk = (int(x) for x in block_size)
    made = cls.from_kv_blocks(
        *kv_lists, BLOCK_SIZE=(bq, bk), mask_mod=mask_mod, seq_lengths=(q_len, kv_len), compute_q_blocks=False
    )
    # what from_kv_blocks would compute from the kv lists (by a dense round trip), from the codes at hand
    made.q_num_blocks, made.q_indices, made.full_q_num_blocks, made.full_q_indices = q_lists
    return made


def _listed(hit: torch.Tensor) -> list[torch.Tensor]:
    """``(num, indices)`` int32 of a bool ``(..., rows, cols)``: each row's count and its columns
    with the kept ones first, in order (FlexAttention's ordered lists)."""
    num = hit.sum(-1, dtype=torch.int32).contiguous()
    order = torch.argsort((~hit).to(torch.int8), dim=-1, stable=True).to(torch.int32).contiguous()
    return [num, order]


class PlannedBlockMask(BlockMask):
    """A torch ``BlockMask`` made by :func:`attnkit.flex.create_block_mask`, holding the
    :class:`~attnkit.PreparedMask` attnkit made it from (``plan``) and the fingerprint its
    ``mask_mod`` had then (``mask_key``, :func:`attnkit._cache.fingerprint`; None: it has none).
    Every method of torch's BlockMask works on it, and torch's ``flex_attention`` runs it; those
    that make a new BlockMask (``[...]``, ``_adjust``, ``to``) make one without a plan, which attnkit
    reads as it reads torch's own."""

    plan = None
    mask_key = None


def planned_block_mask(prepared, codes, block_size, q_len, kv_len, mask_mod, mask_key, separate_full_blocks=True):
    """A torch ``BlockMask`` (of attnkit's subclass) of ``codes``, holding ``prepared`` as its plan
    and ``mask_key`` (the ``mask_mod``'s fingerprint when it was made): what
    :func:`attnkit.flex.create_block_mask` returns."""
    made = _block_mask_of(PlannedBlockMask, codes, block_size, q_len, kv_len, mask_mod, separate_full_blocks)
    made.plan, made.mask_key = prepared, mask_key
    return made


def planned(block_mask):
    """``(plan, mask_key)`` of a BlockMask :func:`planned_block_mask` made, else ``(None, None)``."""
    if isinstance(block_mask, PlannedBlockMask):
        return block_mask.plan, block_mask.mask_key
    return None, None


def mask_mod_of(mask, q_len: int, kv_len: int):
    """``mask`` as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` for one pair (what torch's
    ``flex_attention`` calls under ``torch.vmap``)."""

    def mask_mod(b, h, q_idx, kv_idx):
        e = as4d(mask.elements(q_idx.reshape(1, 1), kv_idx.reshape(1, 1), q_len, kv_len))  # (B or 1, H or 1, 1, 1)
        return e[b.clamp(max=e.shape[0] - 1), h.clamp(max=e.shape[1] - 1), 0, 0]

    mask_mod.__name__ = f"attnkit_{type(mask).__name__.lower()}"
    return mask_mod


def to_block_mask(mask, q_len: int, kv_len: int, BLOCK_SIZE=128, device=None):  # noqa: N803
    """``mask`` as FlexAttention's ``BlockMask``: its block map at ``BLOCK_SIZE`` (partial and full
    blocks listed apart) and a ``mask_mod`` that evaluates it, so torch's ``flex_attention`` runs
    it too. A mask of per-sequence key limits (``padding``) lists the blocks its limits cut as partial.

    >>> from attnkit import masks
    >>> bm = masks.causal().to_block_mask(256, 256)
    >>> bm.kv_num_blocks[0, 0].tolist(), bm.full_kv_num_blocks[0, 0].tolist()
    ([1, 1], [0, 1])
    """
    bq, bk = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    codes = mask.block_map(q_len, kv_len, bq, bk, device)
    return to_torch_block_mask(codes, (bq, bk), q_len, kv_len, mask_mod_of(mask, q_len, kv_len))
