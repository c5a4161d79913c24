"""A torch ``BlockMask`` (FlexAttention's) read as an attnkit mask, and masks written as one.

A ``BlockMask`` lists, per (sequence, head, query block), the key blocks that are partial
(``kv_indices``, their ``mask_mod`` decides each pair) and those that are full
(``full_kv_indices``, every pair kept, ``mask_mod`` never asked); any other block is empty.
:class:`FromBlockMask` keeps that map (copied: masks are values) and asks ``mask_mod`` only
for pairs in partial blocks, as FlexAttention does, at any ``BLOCK_SIZE`` (attnkit's blocks are
judged from the ones they cover).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from attnkit import _cache
from attnkit._validate import AttnkitTypeError, AttnkitValueError, compiling
from attnkit.masks._base import EMPTY, FULL, PARTIAL, Blocks, Mask, as4d

__all__ = [
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


def is_block_mask(obj) -> bool:
    """Whether ``obj`` is torch's FlexAttention ``BlockMask`` (or attnkit's :class:`PlannedBlockMask`)."""
    return isinstance(obj, BlockMask)


def block_codes_of(bm) -> torch.Tensor:
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

    def __init__(self, bm):
        if not is_block_mask(bm):
            raise AttnkitTypeError(
                f"expected a torch.nn.attention.flex_attention.BlockMask, but got {type(bm).__name__}."
            )
        self.codes = block_codes_of(bm)  # (B, H, nq, nk) at the BlockMask's own block size
        self.block_size = tuple(int(x) for x in bm.BLOCK_SIZE)
        self.seq_lengths = tuple(int(x) for x in bm.seq_lengths)
        self.mask_mod = bm.mask_mod
        if getattr(self.mask_mod, "__name__", "") == "noop_mask":
            self.mask_mod = None  # every pair of a partial block kept
        bt, ht = self.codes.shape[:2]
        self.batch_size = bt if bt > 1 else None
        self.num_heads = ht if ht > 1 else None
        self._key = None

    def tensors(self):
        return (self.codes,)

    def lead_shape(self):
        return tuple(self.codes.shape[:2])

    def value_key(self):
        if self._key is None:
            fn = ("noop",) if self.mask_mod is None else _cache.fingerprint(self.mask_mod)
            codes = _cache.fingerprint(self.codes)  # None for a tensor of a transform (no bytes to read)
            if fn is None or codes is None:
                return None
            self._key = ("block_mask", fn, self.block_size, self.seq_lengths, codes)
        return self._key

    def cacheable(self) -> bool:
        return self.value_key() is not None

    def check(self, q_len, kv_len):
        if (q_len, kv_len) != self.seq_lengths:
            raise AttnkitValueError(
                f"the BlockMask was made for Q_LEN={self.seq_lengths[0]}, KV_LEN={self.seq_lengths[1]} but is used "
                f"with Lq={q_len}, Lk={kv_len}: make it for these lengths (create_block_mask(..., {q_len}, {kv_len}))."
            )

    def _code_at(self, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        bq, bk = self.block_size
        codes = self.codes.to(q_idx.device)
        return codes[:, :, (q_idx // bq).reshape(-1, 1), (kv_idx // bk).reshape(1, -1)]  # (B, H, tq, tk)

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        code = self._code_at(q_idx, kv_idx)  # (B, H, tq, tk)
        out = code == FULL
        partial = code == PARTIAL
        if self.mask_mod is None:
            return out | partial
        from attnkit.masks._from_fn import FromFn

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

    def block_codes(self, b):
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
    lists = []
    wanted = (PARTIAL, FULL) if separate_full_blocks else ((PARTIAL, FULL),)
    for code in wanted:
        hit = codes == code if isinstance(code, int) else codes != EMPTY
        num = hit.sum(-1, dtype=torch.int32).contiguous()
        order = torch.argsort((~hit).to(torch.int8), dim=-1, stable=True).to(torch.int32).contiguous()
        lists += [num, order]
    if not separate_full_blocks:
        lists += [None, None]
    bq, bk = (int(x) for x in block_size)
    return cls.from_kv_blocks(
        lists[0], lists[1], lists[2], lists[3], BLOCK_SIZE=(bq, bk), mask_mod=mask_mod, seq_lengths=(q_len, kv_len)
    )


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


def mask_mod_of(mask: Mask, q_len: int, kv_len: int):
    """``mask`` as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` for one pair (what torch's
    ``flex_attention`` calls under ``torch.vmap``)."""

    def mask_mod(b, h, q_idx, kv_idx):
        e = as4d(mask.elements(q_idx.reshape(1, 1), kv_idx.reshape(1, 1), q_len, kv_len))  # (B or 1, H or 1, 1, 1)
        return e[b.clamp(max=e.shape[0] - 1), h.clamp(max=e.shape[1] - 1), 0, 0]

    mask_mod.__name__ = f"attnkit_{type(mask).__name__.lower()}"
    return mask_mod


def to_block_mask(mask: Mask, q_len: int, kv_len: int, BLOCK_SIZE=128, device=None):  # noqa: N803
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
