"""FlexAttention's ``BlockMask`` both ways: a torch ``BlockMask`` read as an attnkit mask, and
masks (and attnkit's plans) written as one. The one module of masks that code outside the
package reads for this (``attnkit.flex``).

A ``BlockMask`` lists, per (sequence, head, query block), the key blocks that are partial
(``kv_indices``, their ``mask_mod`` decides each pair) and those that are full
(``full_kv_indices``, every pair kept, ``mask_mod`` never asked); any other block is empty.
:class:`FromBlockMask` keeps that map (copied: masks are values) and asks ``mask_mod`` only
for pairs in partial blocks, as FlexAttention does, at any ``BLOCK_SIZE`` (attnkit's blocks are
judged from the ones they cover).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch.nn.attention.flex_attention import BlockMask

from attnkit import _cache
from attnkit._types import IntLike
from attnkit._validate import AttnkitTypeError, AttnkitValueError, compiling
from attnkit.masks._base import EMPTY, FULL, PARTIAL, Blocks, Mask, as4d
from attnkit.masks._from_fn import FromFn
from attnkit.masks._lists import (
    PlannedBlockMask,
    mask_mod_of,
    planned,
    planned_block_mask,
    to_block_mask,
    to_torch_block_mask,
)

__all__ = [
    "FULL",
    "PARTIAL",
    "Blocks",
    "FromBlockMask",
    "PlannedBlockMask",
    "block_codes_of",
    "is_block_mask",
    "mask_mod_of",
    "planned",
    "planned_block_mask",
    "regrid",
    "to_block_mask",
    "to_torch_block_mask",
]


def is_block_mask(obj: object) -> bool:
    """Whether ``obj`` is torch's FlexAttention ``BlockMask`` (or attnkit's :class:`PlannedBlockMask`)."""
    return isinstance(obj, BlockMask)


def block_codes_of(bm: BlockMask) -> torch.Tensor:
    """A ``BlockMask``'s map as int8 codes ``(B, H, nq, nk)`` (EMPTY / PARTIAL / FULL), on the CPU."""
    num, idx = bm.kv_num_blocks, bm.kv_indices
    b, h, nq = num.shape
    nk = -(-bm.seq_lengths[1] // bm.BLOCK_SIZE[1])
    width = max(nk, idx.shape[-1])
    codes = torch.full((b, h, nq, width + 1), EMPTY, dtype=torch.int8)  # the last column: a dump for unlisted
    for count, indices, code in ((num, idx, PARTIAL), (bm.full_kv_num_blocks, bm.full_kv_indices, FULL)):
        if count is None or indices is None:
            continue
        count, indices = count.cpu(), indices.cpu().long()
        listed = torch.arange(indices.shape[-1])[None, None, None, :] < count[..., None]  # (B, H, nq, n)
        target = torch.where(listed, indices.clamp(0, width - 1), width)
        codes.scatter_(-1, target, torch.full(target.shape, code, dtype=torch.int8))
    return codes[..., :nk].contiguous()


class FromBlockMask(Mask):
    """FlexAttention's ``BlockMask`` as a mask (see the module's docstring)."""

    def __init__(self, bm: BlockMask, batch: int | None = None) -> None:
        """``batch``: the sequences a call has, where the BlockMask was made for more (torch's kernels
        read its first ``batch`` rows then); None keeps them all."""
        if not is_block_mask(bm):
            raise AttnkitTypeError(
                f"expected a torch.nn.attention.flex_attention.BlockMask, but got {type(bm).__name__}."
            )
        self.codes = block_codes_of(bm)  # (B, H, nq, nk) at the BlockMask's own block size
        if batch is not None and batch < self.codes.shape[0]:
            self.codes = self.codes[:batch].contiguous()
        self.block_size: tuple[int, int] = (int(bm.BLOCK_SIZE[0]), int(bm.BLOCK_SIZE[1]))
        self.seq_lengths: tuple[int, int] = (int(bm.seq_lengths[0]), int(bm.seq_lengths[1]))
        self.mask_mod: Callable[..., torch.Tensor] | None = bm.mask_mod
        if getattr(self.mask_mod, "__name__", "") == "noop_mask":
            self.mask_mod = None  # every pair of a partial block kept
        bt, ht = self.codes.shape[:2]
        self.batch_size = bt if bt > 1 else None
        self.num_heads = ht if ht > 1 else None
        self._key: Hashable | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes,)

    def lead_shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def value_key(self) -> Hashable | None:
        if self._key is None:
            fn = ("noop",) if self.mask_mod is None else _cache.fingerprint(self.mask_mod)
            codes = _cache.fingerprint(self.codes)  # None for a tensor of a transform (no bytes to read)
            if fn is None or codes is None:
                return None
            self._key = ("block_mask", fn, self.block_size, self.seq_lengths, codes)
        return self._key

    def cacheable(self) -> bool:
        return self.value_key() is not None

    def check(self, q_len: int, kv_len: int) -> None:
        if (q_len, kv_len) != self.seq_lengths:
            raise AttnkitValueError(
                f"the BlockMask was made for Q_LEN={self.seq_lengths[0]}, KV_LEN={self.seq_lengths[1]} but is used "
                f"with Lq={q_len}, Lk={kv_len}: make it for these lengths (create_block_mask(..., {q_len}, {kv_len}))."
            )

    def _code_at(self, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        bq, bk = self.block_size
        codes = self.codes.to(q_idx.device)
        return codes[:, :, (q_idx // bq).reshape(-1, 1), (kv_idx // bk).reshape(1, -1)]  # (B, H, tq, tk)

    def elements(self, q_idx: torch.Tensor, kv_idx: torch.Tensor, q_len: int, kv_len: IntLike) -> torch.Tensor:
        code = self._code_at(q_idx, kv_idx)  # (B, H, tq, tk)
        out = code == FULL
        partial = code == PARTIAL
        if self.mask_mod is None:
            return out | partial
        asked = FromFn(self.mask_mod, self.batch_size, self.num_heads, 0, 0)
        if compiling():  # traced: every pair asked, only the partial blocks' answers kept (no host reads)
            e = as4d(asked.elements(q_idx.reshape(-1, 1), kv_idx.reshape(1, -1), q_len, kv_len))
            return out | (partial & e)
        if not bool(partial.any()):  # only full and empty blocks here: mask_mod is not asked
            return out
        q, kv = q_idx.reshape(-1), kv_idx.reshape(-1)
        lead = torch.broadcast_shapes(tuple(out.shape[:2]), asked.lead_shape())
        out = out.expand(*lead, *out.shape[2:]).clone()
        row_blocks = q // self.block_size[0]
        for block in torch.unique(row_blocks[partial.any(-1).any(0).any(0)]).tolist():
            # the rows of one of the BlockMask's query blocks, against the keys of its partial blocks only
            rows = (row_blocks == block).nonzero().reshape(-1)
            cols = partial[:, :, rows].any(-2).any(0).any(0).nonzero().reshape(-1)
            e = as4d(asked.elements(q[rows].reshape(-1, 1), kv[cols].reshape(1, -1), q_len, kv_len))
            hit = partial[:, :, rows][:, :, :, cols] & e
            out[:, :, rows[:, None], cols[None, :]] |= hit.expand(*lead, *hit.shape[2:])
        return out

    def block_codes(self, b: Blocks) -> torch.Tensor:
        return regrid(self.codes.to(b.device), self.block_size, b)

    def __repr__(self):
        name = "noop" if self.mask_mod is None else getattr(self.mask_mod, "__name__", type(self.mask_mod).__name__)
        return f"from_block_mask(BLOCK_SIZE={self.block_size}, seq_lengths={self.seq_lengths}, mask_mod={name})"


def regrid(codes: torch.Tensor, block_size: tuple[int, int], b: Blocks) -> torch.Tensor:
    """Block codes ``(B, H, n, m)`` at ``block_size`` read at the blocks of ``b``: a block is full
    where every block it covers is full, empty where every one is empty, else partial (prefix sums
    over the grid). Exact where ``b``'s block sizes are multiples of ``block_size``; otherwise a
    block that straddles a partial one is partial."""
    bq, bk = block_size
    if (b.bq, b.bk) == (bq, bk):
        return codes[..., : b.nq, : b.nk]
    # b's block (i, j) covers the blocks of rows [i*b.bq, ...] and keys [j*b.bk, ...] at block_size
    q_lo = (torch.arange(b.nq, device=b.device) * b.bq) // bq
    q_hi = (torch.clamp(torch.arange(1, b.nq + 1, device=b.device) * b.bq, max=b.q_len) - 1) // bq
    k_lo = (torch.arange(b.nk, device=b.device) * b.bk) // bk
    k_hi = (torch.clamp(torch.arange(1, b.nk + 1, device=b.device) * b.bk, max=b.keys) - 1) // bk

    def count(where: torch.Tensor) -> torch.Tensor:  # how many covered blocks satisfy ``where``
        s = torch.nn.functional.pad(where.to(torch.int32).cumsum(-1).cumsum(-2), (1, 0, 1, 0))
        r0, r1 = q_lo.view(-1, 1), q_hi.view(-1, 1) + 1
        c0, c1 = k_lo.view(1, -1), k_hi.view(1, -1) + 1
        return s[..., r1, c1] - s[..., r0, c1] - s[..., r1, c0] + s[..., r0, c0]

    area = (q_hi - q_lo + 1).view(-1, 1) * (k_hi - k_lo + 1).view(1, -1)
    return b.code(count(codes == FULL) == area, count(codes == EMPTY) == area)
