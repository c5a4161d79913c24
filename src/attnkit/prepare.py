"""``prepare``: a mask turned into the block lists kernels read, as an explicit value.

A :class:`PreparedMask` holds, per (sequence, head) of the mask and per row block of
``bq`` queries, the key blocks of ``bk`` keys that are not empty and which of them are
full, as tensors (``kv_num``, ``kv_indices``, ``kv_full``: the form a GPU kernel
reads, like FlexAttention's ``BlockMask``), the element masks of the partial blocks as
bits (``bits``, ``tile_ids``), the facts kernels decide on (``band``, ``kept``,
``hides_nothing``, ...) and the host-side plan the CPU kernels walk: rows of the batch and
heads whose block maps are equal share one plan, and each plan lists, per row block, the
runs of adjacent key blocks to visit. Everything is computed once, here, and read-only.

Preparing reads the mask's values once (a host sync); reusing the prepared mask
across layers and decoding steps is the fast path::

    prepared = attnkit.prepare(masks.document(ids) & masks.causal(), L, L)
    for layer in layers:
        x = layer(x, mask=prepared)

``attnkit.attention`` also prepares masks it is given as mask objects, through one
bounded cache (:data:`attnkit._cache.PREPARED`): masks are found by value (their kind,
parameters and the contents of small tensors they hold), others by identity (masks copy
their tensors, so a mask object never changes).
"""

from __future__ import annotations

import itertools
import sys
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from attnkit import _cache
from attnkit import masks as _masks
from attnkit._types import Device
from attnkit._validate import AttnkitTypeError, AttnkitValueError, check_nonnegative_int

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "Group",
    "MaskFacts",
    "MaskLike",
    "PreparedMask",
    "RowBlock",
    "Run",
    "clear_cache",
    "mask_facts",
    "prepare",
    "prepared_for",
]

#: The block size ``prepare`` uses when none is asked for: the CPU kernels' (``benchmarks/cpu.py``).
#: Each kernel declares its own (:attr:`attnkit.kernels.Kernel.block_size`); the registry
#: prepares for the kernel it chooses.
DEFAULT_BLOCK_SIZE = (128, 64)


@dataclass(frozen=True)
class Run:
    """Keys ``[k0, k1)`` of one row block; ``full`` means every pair may attend."""

    k0: int
    k1: int
    full: bool


@dataclass(frozen=True)
class RowBlock:
    """Queries ``[q0, q1)`` and the runs of keys they attend to."""

    q0: int
    q1: int
    runs: tuple[Run, ...]


@dataclass(frozen=True)
class Group:
    """Rows of the batch and heads that share one plan.

    ``batch``/``heads`` index the mask's batch and head axes; None means all of them
    (or the mask does not differ along that axis).
    """

    batch: tuple[int, ...] | None
    heads: tuple[int, ...] | None
    rows: tuple[RowBlock, ...]

    @property
    def masked(self) -> bool:
        return any(not run.full for row in self.rows for run in row.runs)


@dataclass(frozen=True)
class MaskFacts:
    """What a mask object says of itself at some lengths, without reading its values: the one
    place these facts are worked out, for a :class:`PreparedMask` and for a call that has not
    prepared its mask (yet).

    - ``band``: ``(lo, hi)`` when the mask is exactly ``lo <= j - i <= hi`` (causal and window
      masks with int offsets, :meth:`attnkit.masks.Mask.band`), else None;
    - ``limit_only``: the mask hides exactly the keys from each sequence's limit on (padding).
    """

    band: tuple[int | None, int | None] | None
    limit_only: bool

    @property
    def causal_shift(self) -> int | None:
        """``s`` when the mask is exactly "key j visible iff ``j <= i + s``" (0: SDPA's ``is_causal``)."""
        return self.band[1] if self.band is not None and self.band[0] is None else None

    def band_hides_nothing(self, q_len: int, kv_len: int) -> bool:
        """Whether the mask is a band that lets every query see every key at these lengths."""
        if self.band is None:
            return False
        lo, hi = self.band
        return (lo is None or lo <= -(q_len - 1)) and (hi is None or hi >= kv_len - 1)


_NO_MASK = MaskFacts(None, False)


def mask_facts(mask: _masks.Mask | None, q_len: int, kv_len: int) -> MaskFacts:
    """The :class:`MaskFacts` of a mask object (or of no mask) at these lengths."""
    if mask is None:
        return _NO_MASK
    return MaskFacts(mask.band(q_len, kv_len), mask.limit_only())


_UIDS = itertools.count(1)


@dataclass(frozen=True, eq=False)
class PreparedMask:
    """A mask prepared for ``Lq x Lk`` attention; pass it wherever a mask is accepted.

    Every field is computed by :func:`prepare` and read-only (``Bm``/``Hm``: the mask's batch
    and head sizes, 1 where it is the same for all; ``nq = ceil(Lq / bq)``, ``nk = ceil(Lk / bk)``):

    - ``codes (Bm, Hm, nq, nk) int8``: EMPTY / PARTIAL / FULL per block;
    - ``kv_num (Bm, Hm, nq) int32``: kept key blocks per row block;
    - ``kv_indices (Bm, Hm, nq, nk) int32``: their indices first, in order;
    - ``kv_full (Bm, Hm, nq, nk) bool``: whether each listed block is full;
    - ``kv_limit (Bm,) int64`` or None: keys from here on are hidden (never read);
    - ``bits (T, bk, bq // 8) uint8``: the element masks of the partial blocks, key-major, eight
      queries a byte (bit ``r % 8`` of byte ``r // 8`` in key ``c``'s row is query ``r``; 1 = may
      attend; one all-zero tile where there is no partial block); None when ``bq`` is no
      multiple of 8 (see :meth:`partial_bits`);
    - ``tile_ids (Bm, Hm, nq, nk) int32``: for the j-th listed key block of each row block (the
      order of ``kv_indices``), its tile in ``bits``, or -1 for a full block;
    - ``kept``: the mean fraction of blocks a (sequence, head) visits;
    - ``groups``: the CPU kernels' plans (see :class:`Group`); ``masked``: whether any run
      needs its element mask;
    - ``band``, ``causal_shift``, ``limit_only``: the mask's :class:`MaskFacts`;
    - ``hides_nothing``: every pair may attend at these lengths;
    - ``kv_limit_value``: the key limit as a Python int when every sequence has the same one
      (None: no limit, or limits that differ), so a kernel can cut the keys without a sync;
    - ``uid``: a number unique to this prepared mask in the process.

    Kernels read these facts, never the mask's class. :meth:`to` returns a new one.
    """

    mask: _masks.Mask | None
    q_len: int
    kv_len: int
    block_size: tuple[int, int]
    codes: torch.Tensor
    kv_num: torch.Tensor
    kv_indices: torch.Tensor
    kv_full: torch.Tensor
    kv_limit: torch.Tensor | None
    groups: tuple[Group, ...] = field(repr=False)
    kept: float
    bits: torch.Tensor | None = field(repr=False)
    tile_ids: torch.Tensor = field(repr=False)
    band: tuple[int | None, int | None] | None = None
    limit_only: bool = False
    kv_limit_value: int | None = None
    masked: bool = False
    hides_nothing: bool = False
    causal_shift: int | None = None
    uid: int = field(default_factory=lambda: next(_UIDS), repr=False, compare=False)
    #: forms derived on request (int8 element masks, a device's copies): written by this class only
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def everything(self) -> bool:
        """The same as :attr:`hides_nothing`."""
        return self.hides_nothing

    def partial_bits(self, device: Device = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The element masks of the partial blocks one byte a pair, for kernels that read them so.

        Returns ``bits (T, bq, bk) int8`` (1 = may attend; at least one tile) and ``tile_ids``
        as the field (the index of each listed block's tile, -1 for a full block), on ``device``
        (default: the mask's). Unpacked from :attr:`bits` once per device.
        """
        device = torch.device(device) if device is not None else self.device
        key = ("partial_bits", str(device))
        found = self._derived.get(key)
        if found is None:
            if self.bits is not None:
                bq, bk = self.block_size
                shifts = torch.arange(8, dtype=torch.uint8, device=self.bits.device)
                rows = (self.bits[..., None] >> shifts) & 1  # (T, bk, bq/8, 8)
                int8 = rows.reshape(self.bits.shape[0], bk, bq).transpose(1, 2).to(torch.int8)
            else:
                int8 = _partial_tiles(self)[0]
            found = (int8.to(device).contiguous(), self.tile_ids.to(device).contiguous())
            self._derived[key] = found
        return found

    def packed_partial_bits(self, device: Device = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:attr:`bits` and :attr:`tile_ids` on ``device`` (default: the mask's).

        >>> import attnkit
        >>> p = attnkit.prepare(attnkit.masks.causal(), 16, 16, block_size=(8, 8))
        >>> bits, ids = p.packed_partial_bits()
        >>> bits.shape, bin(int(bits[0, 2, 0]))  # key 2 of the first diagonal tile: queries 2..7
        (torch.Size([2, 8, 1]), '0b11111100')
        """
        if self.bits is None:
            raise AttnkitValueError(
                f"packed bits need a block of queries that is a multiple of 8, not {self.block_size[0]}."
            )
        device = torch.device(device) if device is not None else self.device
        if device == self.device:
            return self.bits, self.tile_ids
        key = ("packed", str(device))
        found = self._derived.get(key)
        if found is None:
            found = self._derived[key] = (self.bits.to(device), self.tile_ids.to(device))
        return found

    def native_plan(self) -> tuple:
        """``(kv_num, kv_indices, tile_ids, bits, kv_limit)`` on the CPU: the native engine's operands."""
        bits, tile_ids = self.packed_partial_bits("cpu")
        if self.device.type == "cpu":
            return self.kv_num, self.kv_indices, tile_ids, bits, self.kv_limit
        limit = None if self.kv_limit is None else self.kv_limit.cpu()
        return self.kv_num.cpu(), self.kv_indices.cpu(), tile_ids, bits, limit

    def block_tiles(self) -> torch.Tensor:
        """``(Bm, Hm, nq, nk) int32``: the tile of each block (by block index, not listed order), -1
        for a full or empty block."""
        found = self._derived.get("block_tiles")
        if found is None:
            found = torch.full(self.codes.shape, -1, dtype=torch.int32, device=self.device)
            found.scatter_(-1, self.kv_indices.long(), self.tile_ids)
            found = found.masked_fill(self.codes != _masks.PARTIAL, -1)
            self._derived["block_tiles"] = found
        return found

    def allowed(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """The allowed pairs of queries ``[q0, q1)`` and keys ``[k0, k1)``: ``(Bm or 1, Hm or 1, n, S)``
        bool, evaluated from the mask (or, for a plan rebuilt from tensors, read from the bits)."""
        if self.mask is not None:
            from attnkit._indexing import as4d

            q_idx = torch.arange(q0, q1, device=self.device)[:, None]
            kv_idx = torch.arange(k0, k1, device=self.device)[None, :]
            return as4d(self.mask.elements(q_idx, kv_idx, self.q_len, self.kv_len))
        bq, bk = self.block_size
        int8, _ = self.partial_bits()
        tiles = self.block_tiles()
        bm, hm = self.codes.shape[:2]
        out = torch.zeros(bm, hm, q1 - q0, k1 - k0, dtype=torch.bool, device=self.device)
        for i in range(q0 // bq, -(-q1 // bq)):
            for j in range(k0 // bk, -(-k1 // bk)):
                r0, r1, c0, c1 = max(q0, i * bq), min(q1, (i + 1) * bq), max(k0, j * bk), min(k1, (j + 1) * bk)
                codes = self.codes[:, :, i, j]  # (Bm, Hm)
                tile = int8[tiles[:, :, i, j].clamp(min=0).long()][
                    ..., r0 - i * bq : r1 - i * bq, c0 - j * bk : c1 - j * bk
                ]
                block = torch.where(
                    (codes == _masks.FULL)[..., None, None],
                    True,
                    (codes == _masks.PARTIAL)[..., None, None] & (tile == 1),
                )
                out[:, :, r0 - q0 : r1 - q0, c0 - k0 : c1 - k0] = block
        return out

    @property
    def lead_shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.codes.shape[1])

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(Bm, Hm, Lq, Lk)``: the shape of the dense mask it stands for (see :meth:`materialize`)."""
        return (*self.lead_shape, self.q_len, self.kv_len)

    @property
    def ndim(self) -> int:
        """4, like the dense mask it stands for (code that checks a mask's rank can hold one)."""
        return 4

    def to(self, device: Device) -> PreparedMask:
        """The same prepared mask with its tensors on ``device`` (a new value)."""
        if self.mask is None and self.groups and self.masked:
            return rebuilt(
                self.q_len, self.kv_len, self.block_size, self.codes.to(device),
                None if self.kv_limit is None else self.kv_limit.to(device),
                None if self.bits is None else self.bits.to(device), self.tile_ids.to(device), self.band,
            )  # fmt: skip
        return prepare(self.mask, self.q_len, self.kv_len, device=device, block_size=self.block_size)

    def with_block_size(self, block_size: tuple[int, int]) -> PreparedMask:
        """The same mask prepared for another block size (through the implicit cache: once)."""
        if tuple(block_size) == self.block_size:
            return self
        if self.mask is None and self.masked:
            raise AttnkitValueError(
                f"this plan was rebuilt from tensors at block size {self.block_size} and holds no mask to "
                f"prepare again at {tuple(block_size)}."
            )
        return prepared_for(self.mask, self.q_len, self.kv_len, self.device, (block_size[0], block_size[1]))

    def materialize(self, device: Device = None) -> torch.Tensor:
        """The dense bool mask ``(Bm, Hm, Lq, Lk)`` (True = may attend)."""
        if self.mask is None and not self.masked and self.kv_limit is None and self.hides_nothing:
            return torch.ones(1, 1, self.q_len, self.kv_len, dtype=torch.bool, device=device or self.device)
        if self.mask is None:
            return self.allowed(0, self.q_len, 0, self.kv_len).to(device or self.device)
        return self.mask.materialize(self.q_len, self.kv_len, device or self.device, check=False)

    def __repr__(self) -> str:
        bq, bk = self.block_size
        return (
            f"PreparedMask({self.mask!r}, Lq={self.q_len}, Lk={self.kv_len}, blocks={bq}x{bk}, "
            f"lead_shape={self.lead_shape}, kept={self.kept:.0%}, plans={len(self.groups)})"
        )


#: What ``mask=`` takes: a mask object, a prepared mask, a bool or float tensor, or None.
MaskLike = _masks.Mask | PreparedMask | torch.Tensor | None


def prepare(
    mask: _masks.Mask | torch.Tensor | None,
    q_len: int,
    kv_len: int,
    *,
    device: Device = None,
    block_size: tuple[int, int] | None = None,
) -> PreparedMask:
    """Prepare ``mask`` for attention of ``q_len`` queries over ``kv_len`` keys.

    ``mask`` is an attnkit mask object, a bool tensor (True = may attend, broadcast
    from the right like SDPA's ``attn_mask``) or None. The result holds the block lists
    and the partial blocks' bits on ``device`` (default: the mask's own) and the CPU
    kernels' per-row plans. Reuse it for every call with these lengths: no further host syncs.

    >>> import attnkit
    >>> p = attnkit.prepare(attnkit.masks.causal(), 256, 256)
    >>> p.kept, p.kv_num[0, 0].tolist()
    (0.75, [2, 4])
    """
    if isinstance(mask, PreparedMask):
        raise AttnkitTypeError("mask is already a PreparedMask; use it as it is, or .to(device).")
    q_len = check_nonnegative_int(q_len, "q_len")
    kv_len = check_nonnegative_int(kv_len, "kv_len")
    mask = None if mask is None else _masks.as_mask(mask)
    bq, bk = block_size if block_size is not None else DEFAULT_BLOCK_SIZE
    bq, bk = check_nonnegative_int(bq, "bq"), check_nonnegative_int(bk, "bk")
    if bq == 0 or bk == 0:
        raise AttnkitValueError(f"block sizes must be positive, but got block_size=({bq}, {bk}).")
    if device is None:
        device = mask._device() if mask is not None else None
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "meta":
        raise AttnkitValueError(
            "prepare reads the mask's block map on the host and cannot make a PreparedMask on the meta device: "
            "prepare on a real device (e.g. 'cpu') and move it with .to()."
        )
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    limit = None
    if mask is None:
        codes = torch.full((1, 1, nq, nk), _masks.FULL, dtype=torch.int8, device=device)
    else:
        mask.check(q_len, kv_len)
        mask.check_values(q_len, kv_len)
        limit = mask.key_limit()
        if limit is not None:
            limit = limit.to(device=device, dtype=torch.int64).clamp(0, kv_len)
            if bool((limit >= kv_len).all()):
                limit = None  # nothing to cut
        codes = mask._block_map(q_len, kv_len, bq, bk, device, limit)
        codes = codes.contiguous()
    return _assemble(mask, q_len, kv_len, (bq, bk), codes, limit, mask_facts(mask, q_len, kv_len).band, None)


def _assemble(mask, q_len, kv_len, block_size, codes, limit, band, bits_and_ids) -> PreparedMask:
    """A PreparedMask from its block codes: the block lists, bits, plans and facts."""
    bq, bk = block_size
    kept_blocks = codes != _masks.EMPTY
    order = torch.argsort((~kept_blocks).to(torch.int8), dim=-1, stable=True)
    kv_num = kept_blocks.sum(-1, dtype=torch.int32).contiguous()
    kv_indices = order.to(torch.int32).contiguous()
    kv_full = torch.gather(codes, -1, order) == _masks.FULL
    kept = float(kept_blocks.float().mean()) if codes.numel() else 0.0
    limits = None if limit is None else limit.cpu().numpy()
    groups = _plan_groups(codes.cpu().numpy(), limits, q_len, kv_len, bq, bk)
    shared_limit = None
    if limits is not None and limits.size and not (limits != limits.flat[0]).any():
        shared_limit = int(limits.flat[0])
    masked = any(g.masked for g in groups)
    facts = MaskFacts(band, mask is not None and mask.limit_only())
    if bits_and_ids is None:
        bits, tile_ids = _partial_tiles_packed(mask, q_len, kv_len, block_size, codes, kv_indices)
    else:
        bits, tile_ids = bits_and_ids
    prepared = PreparedMask(
        mask,
        q_len,
        kv_len,
        (bq, bk),
        codes,
        kv_num,
        kv_indices,
        kv_full,
        limit,
        groups,
        kept,
        bits,
        tile_ids,
        band,
        facts.limit_only,
        shared_limit,
        masked,
        bool(kept == 1.0 and not masked and limit is None),
        facts.causal_shift,
    )
    if bits is not None and "torch._dynamo" in sys.modules:  # torch.compile in use: another layout's
        torch._dynamo.maybe_mark_dynamic(bits, 0)  # number of partial tiles runs the same compiled graph
    return prepared


def rebuilt(
    q_len: int,
    kv_len: int,
    block_size: tuple[int, int],
    codes: torch.Tensor,
    kv_limit: torch.Tensor | None,
    bits: torch.Tensor | None,
    tile_ids: torch.Tensor,
    band: tuple[int | None, int | None] | None,
) -> PreparedMask:
    """A PreparedMask from the tensors of one (the plan compiled code carries as arguments):
    its groups are planned again from ``codes``, its partial blocks read from ``bits``."""
    return _assemble(None, q_len, kv_len, tuple(block_size), codes, kv_limit, band, (bits, tile_ids))


def _partial_tiles_packed(mask, q_len, kv_len, block_size, codes, kv_indices):
    """``(bits or None, tile_ids)`` at preparation (see :class:`PreparedMask`)."""
    bq, _ = block_size
    int8, listed = _partial_tiles_of(mask, q_len, kv_len, block_size, codes, kv_indices)
    if bq % 8:
        return None, listed
    t, bk = int8.shape[0], int8.shape[2]
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=int8.device)
    keys = int8.transpose(1, 2).reshape(t, bk, bq // 8, 8).to(torch.uint8)  # (T, bk, bq/8, 8)
    packed = (keys * weights).sum(-1, dtype=torch.uint8).contiguous()  # distinct powers of two: no carry
    return packed, listed


def _partial_tiles(prepared: PreparedMask) -> tuple[torch.Tensor, torch.Tensor]:
    return _partial_tiles_of(
        prepared.mask, prepared.q_len, prepared.kv_len, prepared.block_size, prepared.codes, prepared.kv_indices
    )


def _partial_tiles_of(mask, q_len, kv_len, block_size, codes, kv_indices) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bits (T, bq, bk) int8, tile_ids)`` of the partial blocks (one host sync: which blocks are
    partial). The mask is evaluated once per row block, over the key blocks partial in some
    sequence or head; at least one tile (all zeros where there is no partial block)."""
    from attnkit._indexing import as4d

    device = codes.device
    bq, bk = block_size
    bm, hm, nq, nk = codes.shape
    ids = torch.full((bm, hm, nq, nk), -1, dtype=torch.int32)
    tiles: list[torch.Tensor] = []
    by_row: dict = {}
    for b, h, i, j in (codes == _masks.PARTIAL).nonzero().tolist():
        by_row.setdefault(i, {}).setdefault(j, []).append((b, h))
    last_q, last_k = max(q_len - 1, 0), max(kv_len - 1, 0)
    for i, blocks in by_row.items():
        assert mask is not None, "partial blocks come from a mask"
        columns = sorted(blocks)
        q_idx = torch.arange(i * bq, (i + 1) * bq)[:, None]
        kv_idx = (torch.tensor(columns)[:, None] * bk + torch.arange(bk)[None, :]).reshape(1, -1)  # (1, n * bk)
        inside = (q_idx < q_len) & (kv_idx < kv_len)
        e = as4d(mask.elements(q_idx.clamp(max=last_q), kv_idx.clamp(max=last_k), q_len, kv_len)).cpu()
        e = e.expand(*e.shape[:2], bq, kv_idx.shape[1]) & inside  # (Bm or 1, Hm or 1, bq, n * bk)
        for n, j in enumerate(columns):
            for b, h in blocks[j]:
                ids[b, h, i, j] = len(tiles)
                tiles.append(e[min(b, e.shape[0] - 1), min(h, e.shape[1] - 1), :, n * bk : (n + 1) * bk])
    bits = torch.stack(tiles).to(torch.int8) if tiles else torch.zeros(1, bq, bk, dtype=torch.int8)
    listed = ids.gather(-1, kv_indices.long().cpu().clamp(min=0))
    return bits.to(device).contiguous(), listed.to(device).contiguous()


# --- the CPU kernel's plans -----------------------------------------------------------

#: A stretch of FULL key blocks shorter than this is computed with its PARTIAL
#: neighbours under one mask: one masked call is cheaper than splitting and merging.
MIN_FULL_RUN = 1024
#: Adjacent row blocks with the same runs are computed as one, up to this many
#: (query, key) pairs per run when the run needs its element mask.
MAX_MASKED_TILE = 2**20
MAX_ROWS = 4096


def _plan_groups(codes: np.ndarray, limit, q_len, kv_len, bq, bk) -> tuple[Group, ...]:
    """Group rows (and heads) with equal block maps and limits; one plan per group."""
    bm, hm = codes.shape[:2]
    by_batch: dict = {}
    for b in range(bm):
        key = (codes[b].tobytes(), None if limit is None else int(limit[b]))
        by_batch.setdefault(key, []).append(b)
    groups = []
    for (_, lim), rows in by_batch.items():
        batch = None if len(by_batch) == 1 else tuple(rows)
        by_head: dict = {}
        for h in range(hm):
            by_head.setdefault(codes[rows[0], h].tobytes(), []).append(h)
        for heads in by_head.values():
            state = codes[rows[0], heads[0]]
            end = kv_len if lim is None else lim
            groups.append(
                Group(batch, None if len(by_head) == 1 else tuple(heads), _plan_rows(state, end, q_len, bq, bk))
            )
    return tuple(groups)


def _plan_rows(state: np.ndarray, kv_end: int, q_len: int, bq: int, bk: int) -> tuple[RowBlock, ...]:
    rows: list[RowBlock] = []
    for i in range(state.shape[0]):
        block = RowBlock(i * bq, min((i + 1) * bq, q_len), _runs(state[i], bk, kv_end))
        if rows and rows[-1].runs == block.runs and _can_grow(rows[-1], block):
            block = RowBlock(rows[-1].q0, block.q1, block.runs)  # one call for both
            rows.pop()
        rows.append(block)
    return tuple(rows)


def _can_grow(prev: RowBlock, block: RowBlock) -> bool:
    rows = block.q1 - prev.q0
    if rows > MAX_ROWS:
        return False
    return all(run.full or rows * (run.k1 - run.k0) <= MAX_MASKED_TILE for run in block.runs)


def _runs(row: np.ndarray, bk: int, kv_end: int) -> tuple[Run, ...]:
    """The runs of one row of block codes, keys clipped at ``kv_end``.

    Non-empty blocks that touch form one run; a FULL stretch of at least
    MIN_FULL_RUN keys becomes a run of its own that skips the element mask.
    """
    idx = np.flatnonzero(row)
    if idx.size == 0:
        return ()
    codes = row[idx]
    breaks = np.flatnonzero((np.diff(idx) != 1) | (np.diff(codes) != 0)) + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), idx.size]
    segments = [
        (int(idx[s]) * bk, min(int(idx[e - 1] + 1) * bk, kv_end), bool(codes[s] == _masks.FULL))
        for s, e in zip(starts, ends)
    ]
    segments = [seg for seg in segments if seg[1] > seg[0]]

    def touches_partial(i: int) -> bool:
        before = i > 0 and segments[i - 1][1] == segments[i][0] and not segments[i - 1][2]
        after = i + 1 < len(segments) and segments[i + 1][0] == segments[i][1] and not segments[i + 1][2]
        return before or after

    # a full stretch too short to be worth a call of its own joins its partial neighbours
    runs: list[list] = []
    for i, (k0, k1, full) in enumerate(segments):
        full = full and (k1 - k0 >= MIN_FULL_RUN or not touches_partial(i))
        if runs and runs[-1][1] == k0 and runs[-1][2] == full:
            runs[-1][1] = k1
        else:
            runs.append([k0, k1, full])
    return tuple(Run(k0, k1, full) for k0, k1, full in runs)


# --- the implicit cache ---------------------------------------------------------------


#: How many preparations the implicit cache has made (tests count them).
PREPARATIONS = {"count": 0}


def prepared_for(
    mask: _masks.Mask | None, q_len: int, kv_len: int, device: Device, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE
) -> PreparedMask:
    """``prepare(mask, q_len, kv_len, device=device, block_size=block_size)`` through the
    bounded implicit cache (:data:`attnkit._cache.PREPARED`): once per (mask, lengths, device,
    block size).

    Masks are found by value (:meth:`attnkit.masks.Mask.value_key`: kind, parameters and the
    contents of small tensors), others by identity, held weakly and checked.
    """
    value_key = ("no mask",) if mask is None else mask.value_key()
    if value_key is None and mask is not None and not mask.cacheable():  # may change behind its identity
        PREPARATIONS["count"] += 1
        return prepare(mask, q_len, kv_len, device=device, block_size=block_size)
    key = (value_key if value_key is not None else ("id", id(mask)), q_len, kv_len, str(device), tuple(block_size))
    hit = _cache.PREPARED.get(key)
    if hit is not None:
        ref, prepared = hit
        if ref is None or ref() is mask:
            return prepared
        _cache.PREPARED.pop(key)
    prepared = prepare(mask, q_len, kv_len, device=device, block_size=block_size)
    PREPARATIONS["count"] += 1
    ref = None if value_key is not None else weakref.ref(mask)
    _cache.PREPARED.put(key, (ref, prepared))
    return prepared


def clear_cache() -> None:
    """Forget every implicitly prepared mask."""
    _cache.PREPARED.clear()
