"""``prepare``: a mask turned into the block lists kernels read, as an explicit value.

A :class:`PreparedMask` holds, per (sequence, head) of the mask and per row block of
``bq`` queries, the key blocks of ``bk`` keys that are not empty and which of them are
full, as tensors (``kv_num``, ``kv_indices``, ``kv_full``: the form a GPU kernel
reads, like FlexAttention's ``BlockMask``), and the host-side plan the CPU kernel
walks: rows of the batch and heads whose block maps are equal share one plan, and
each plan lists, per row block, the runs of adjacent key blocks to visit.

Preparing reads the mask's values once (a host sync); reusing the prepared mask
across layers and decoding steps is the fast path::

    prepared = attnkit.prepare(masks.document(ids) & masks.causal(), L, L)
    for layer in layers:
        x = layer(x, mask=prepared)

``attnkit.attention`` also prepares masks it is given as mask objects, through one
bounded cache owned by this module (:data:`IMPLICIT_CACHE_SIZE` entries, each with
at most :data:`TILE_CACHE_BYTES` of evaluated mask tiles). Masks without tensors
(causal, windows, int prefixes) are found there by value, masks holding tensors by
identity (masks copy their tensors, so a mask object never changes).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from attnkit import masks as _masks
from attnkit._types import Device
from attnkit._validate import AttnkitTypeError, AttnkitValueError, check_nonnegative_int

__all__ = ["prepare", "PreparedMask", "Run", "RowBlock", "Group", "DEFAULT_BLOCK_SIZE", "prepared_for", "clear_cache"]

#: Evaluated mask tiles a prepared mask may keep (bytes).
TILE_CACHE_BYTES = 64 * 2**20
#: Prepared masks kept by the implicit cache of :func:`attnkit.attention`.
IMPLICIT_CACHE_SIZE = 16


#: The block size ``prepare`` uses when none is asked for: the CPU kernel's (``benchmarks/cpu.py``).
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


class _TileCache:
    """Evaluated mask tiles of one prepared mask, bounded in bytes, thread-safe."""

    def __init__(self, limit: int):
        self.limit, self.size = limit, 0
        self.tiles: dict[object, Any] = {}
        self.lock = threading.Lock()

    def get(self, key):
        return self.tiles.get(key)

    def put(self, key, value, nbytes: int, within: float = 1.0) -> bool:
        """Keep ``value`` if it fits in ``within`` of the bound (returns whether the key is now held)."""
        with self.lock:
            if key in self.tiles:
                return True
            if self.size + nbytes <= within * self.limit:
                self.tiles[key] = value
                self.size += nbytes
                return True
            return False


@dataclass(frozen=True, eq=False)
class PreparedMask:
    """A mask prepared for ``Lq x Lk`` attention; pass it wherever a mask is accepted.

    Attributes (``Bm``/``Hm``: the mask's batch and head sizes, 1 where it is the same
    for all; ``nq = ceil(Lq / bq)``, ``nk = ceil(Lk / bk)``):

    - ``codes (Bm, Hm, nq, nk) int8``: EMPTY / PARTIAL / FULL per block;
    - ``kv_num (Bm, Hm, nq) int32``: kept key blocks per row block;
    - ``kv_indices (Bm, Hm, nq, nk) int32``: their indices first, in order;
    - ``kv_full (Bm, Hm, nq, nk) bool``: whether each listed block is full;
    - ``kv_limit (Bm,)`` or None: keys from here on are hidden (never read);
    - ``kept``: the mean fraction of blocks a (sequence, head) visits;
    - ``groups``: the CPU kernel's plans (see :class:`Group`);
    - ``band``: ``(lo, hi)`` when the mask is exactly the band ``lo <= j - i <= hi`` (causal
      and sliding-window masks with int offsets, see :meth:`attnkit.masks.Mask.band`), so a
      kernel can evaluate partial blocks from two ints; None otherwise;
    - ``limit_only``: the mask hides exactly the keys from ``kv_limit`` on (padding);
    - ``kv_limit_value``: the key limit as a Python int when every sequence has the same one
      (None: no limit, or limits that differ), so a kernel can cut the keys without a sync.

    Kernels read these facts (and :attr:`causal_shift`, :attr:`hides_nothing`,
    :meth:`partial_bits`), never the mask's class. It is immutable: :meth:`to` returns a
    new one.
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
    tiles: _TileCache = field(repr=False, compare=False)
    band: tuple[int | None, int | None] | None = None
    limit_only: bool = False
    kv_limit_value: int | None = None
    #: A 0-d int64 tensor naming this prepared mask: compiled code passes it to attnkit's custom
    #: ops, whose eager implementations find the mask from it (see :func:`from_handle`).
    handle: torch.Tensor | None = field(default=None, repr=False, compare=False)

    #: The handle's number as a Python int (for keys: no host read of the tensor).
    handle_id: int = field(default=0, repr=False, compare=False)

    def __post_init__(self):
        number = next(_HANDLES)
        object.__setattr__(self, "handle", torch.tensor(number, dtype=torch.int64))
        object.__setattr__(self, "handle_id", number)
        _LIVE[number] = self

    @property
    def masked(self) -> bool:
        """Whether any visited block needs its element mask."""
        return any(g.masked for g in self.groups)

    @property
    def hides_nothing(self) -> bool:
        """Whether every pair may attend (the mask hides nothing at these lengths)."""
        return bool(self.kept == 1.0 and not self.masked and self.kv_limit is None)

    everything = hides_nothing

    @property
    def causal_shift(self) -> int | None:
        """``s`` when the mask is exactly "key j visible iff ``j <= i + s``" (a causal mask with
        int offsets; 0 is SDPA's ``is_causal``), else None."""
        if self.band is None or self.band[0] is not None or self.mask is None:
            return None
        return self.band[1]

    def partial_bits(self, device: Device = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The element masks of the partial blocks, for kernels that read masks as data.

        Returns ``bits (T, bq, bk) int8`` (1 = may attend; at least one tile) and
        ``tile_ids (Bm, Hm, nq, nk) int32``: for the j-th listed key block of each row block
        (the order of ``kv_indices``), the index of its tile in ``bits``, or -1 for a full
        block. O(partial blocks) bytes; computed once per prepared mask and device.
        """
        device = torch.device(device) if device is not None else self.device
        key = ("partial_bits", str(device))
        found = self.tiles.get(key)
        if found is None:
            found = _partial_bits(self, device)
            self.tiles.put(key, found, found[0].numel() + 4 * found[1].numel())
        return found

    def packed_partial_bits(self, device: Device = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The element masks of the partial blocks key-major, eight queries a byte: for kernels
        that read one key's mask over a run of queries as a word of bits.

        Returns ``bits (T, bk, bq // 8) uint8``, where bit ``r % 8`` of byte ``r // 8`` in key
        ``c``'s row of tile ``t`` is ``partial_bits()[0][t, r, c]`` (1 = may attend), and
        ``tile_ids`` as :meth:`partial_bits` gives them. One bit a pair; computed once per
        prepared mask and device. Needs ``bq`` a multiple of 8.

        >>> import attnkit
        >>> p = attnkit.prepare(attnkit.masks.causal(), 16, 16, block_size=(8, 8))
        >>> bits, ids = p.packed_partial_bits()
        >>> bits.shape, bin(int(bits[0, 2, 0]))  # key 2 of the first diagonal tile: queries 2..7
        (torch.Size([2, 8, 1]), '0b11111100')
        """
        device = torch.device(device) if device is not None else self.device
        bq, bk = self.block_size
        if bq % 8:
            raise AttnkitValueError(f"packed_partial_bits needs a block of queries that is a multiple of 8, not {bq}.")
        key = ("packed_partial_bits", str(device))
        found = self.tiles.get(key)
        if found is None:
            rows = self.tiles.get(("partial_bits", str(device)))  # not kept by this call: 8x the bytes
            bits, tile_ids = rows if rows is not None else _partial_bits(self, device)
            weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=bits.device)
            keys = bits.transpose(1, 2).reshape(bits.shape[0], bk, bq // 8, 8).to(torch.uint8)  # (T, bk, bq/8, 8)
            packed = (keys * weights).sum(-1).to(torch.uint8).contiguous()  # distinct powers of two: no carry
            found = (packed, tile_ids)
            self.tiles.put(key, found, packed.numel() + 4 * tile_ids.numel())
        return found

    def native_plan(self) -> tuple:
        """``(kv_num, kv_indices, tile_ids, bits, kv_limit)`` on the CPU as the native engine's
        operators read them: int32 block lists, int32 tile ids, the packed partial bits (uint8)
        and the key limit (int64, or None)."""
        key = ("native plan",)
        found = self.tiles.get(key)
        if found is None:
            kv_num, kv_indices = (t.cpu().to(torch.int32).contiguous() for t in (self.kv_num, self.kv_indices))
            bits, tile_ids = self.packed_partial_bits(torch.device("cpu"))
            limit = None if self.kv_limit is None else self.kv_limit.cpu().to(torch.int64).contiguous()
            found = (kv_num, kv_indices, tile_ids, bits, limit)
            self.tiles.put(key, found, sum(t.numel() * t.element_size() for t in found[:2]))
        return found

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
        return prepare(self.mask, self.q_len, self.kv_len, device=device, block_size=self.block_size)

    def with_block_size(self, block_size: tuple[int, int]) -> PreparedMask:
        """The same mask prepared for another block size (through the implicit cache: once)."""
        if tuple(block_size) == self.block_size:
            return self
        return prepared_for(self.mask, self.q_len, self.kv_len, self.device, (block_size[0], block_size[1]))

    def materialize(self, device: Device = None) -> torch.Tensor:
        """The dense bool mask ``(Bm, Hm, Lq, Lk)`` (True = may attend)."""
        if self.mask is None:
            return torch.ones(1, 1, self.q_len, self.kv_len, dtype=torch.bool, device=device or self.device)
        return self.mask.materialize(self.q_len, self.kv_len, device or self.device, check=False)

    def __repr__(self) -> str:
        bq, bk = self.block_size
        return (
            f"PreparedMask({self.mask!r}, Lq={self.q_len}, Lk={self.kv_len}, blocks={bq}x{bk}, "
            f"lead_shape={self.lead_shape}, kept={self.kept:.0%}, plans={len(self.groups)})"
        )


_HANDLES = itertools.count(1)
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def from_handle(handle: torch.Tensor) -> PreparedMask:
    """The prepared mask a :attr:`PreparedMask.handle` names (for custom ops running compiled code)."""
    found = _LIVE.get(int(handle))
    if found is None:
        raise AttnkitValueError(
            "the PreparedMask this compiled call was traced with no longer exists: keep a "
            "reference to it while the compiled function runs."
        )
    return found


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
    on ``device`` (default: the mask's own) and the CPU kernel's per-row plans.
    Reuse it for every call with these lengths: no further host syncs.

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
            limit = limit.to(device).clamp(0, kv_len)
            if bool((limit >= kv_len).all()):
                limit = None  # nothing to cut
        codes = mask._block_map(q_len, kv_len, bq, bk, device, limit)
        codes = codes.contiguous()
    kept_blocks = codes != _masks.EMPTY
    order = torch.argsort((~kept_blocks).to(torch.int8), dim=-1, stable=True)
    kv_num = kept_blocks.sum(-1, dtype=torch.int32)
    kv_indices = order.to(torch.int32)
    kv_full = torch.gather(codes, -1, order) == _masks.FULL
    kept = float(kept_blocks.float().mean()) if codes.numel() else 0.0
    limits = None if limit is None else limit.cpu().numpy()
    groups = _plan_groups(codes.cpu().numpy(), limits, q_len, kv_len, bq, bk)
    shared_limit = None
    if limits is not None and limits.size and not (limits != limits.flat[0]).any():
        shared_limit = int(limits.flat[0])
    band = None if mask is None else mask.band(q_len, kv_len)
    limit_only = mask is not None and mask.limit_only()
    return PreparedMask(
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
        _TileCache(TILE_CACHE_BYTES),
        band,
        limit_only,
        shared_limit,
    )


def _partial_bits(prepared: PreparedMask, device) -> tuple[torch.Tensor, torch.Tensor]:
    """See :meth:`PreparedMask.partial_bits` (one host sync: which blocks are partial). The mask
    is evaluated once per row block, over the key blocks partial in some sequence or head."""
    from attnkit._indexing import as4d

    codes = prepared.codes
    bq, bk = prepared.block_size
    bm, hm, nq, nk = codes.shape
    ids = torch.full((bm, hm, nq, nk), -1, dtype=torch.int32)
    tiles: list[torch.Tensor] = []
    by_row: dict = {}
    for b, h, i, j in (codes == _masks.PARTIAL).nonzero().tolist():
        by_row.setdefault(i, {}).setdefault(j, []).append((b, h))
    last_q, last_k = max(prepared.q_len - 1, 0), max(prepared.kv_len - 1, 0)
    mask = prepared.mask
    for i, blocks in by_row.items():
        assert mask is not None, "partial blocks come from a mask"
        columns = sorted(blocks)
        q_idx = torch.arange(i * bq, (i + 1) * bq)[:, None]
        kv_idx = (torch.tensor(columns)[:, None] * bk + torch.arange(bk)[None, :]).reshape(1, -1)  # (1, n * bk)
        inside = (q_idx < prepared.q_len) & (kv_idx < prepared.kv_len)
        e = as4d(
            mask.elements(q_idx.clamp(max=last_q), kv_idx.clamp(max=last_k), prepared.q_len, prepared.kv_len)
        ).cpu()
        e = e.expand(*e.shape[:2], bq, kv_idx.shape[1]) & inside  # (Bm or 1, Hm or 1, bq, n * bk)
        for n, j in enumerate(columns):
            for b, h in blocks[j]:
                ids[b, h, i, j] = len(tiles)
                tiles.append(e[min(b, e.shape[0] - 1), min(h, e.shape[1] - 1), :, n * bk : (n + 1) * bk])
    bits = torch.stack(tiles).to(torch.int8) if tiles else torch.ones(1, bq, bk, dtype=torch.int8)
    listed = ids.gather(-1, prepared.kv_indices.long().cpu().clamp(min=0))
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

_implicit: OrderedDict = OrderedDict()
_implicit_lock = threading.Lock()


#: How many preparations the implicit cache has made (tests count them).
PREPARATIONS = {"count": 0}


def prepared_for(
    mask: _masks.Mask | None, q_len: int, kv_len: int, device: Device, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE
) -> PreparedMask:
    """``prepare(mask, q_len, kv_len, device=device, block_size=block_size)`` through the
    bounded implicit cache: once per (mask, lengths, device, block size).

    Masks are found by value (:meth:`attnkit.masks.Mask.value_key`: kind, parameters and small
    CPU tensors), others by identity.
    """
    value_key = ("no mask",) if mask is None else mask.value_key()
    key = (value_key if value_key is not None else ("id", id(mask)), q_len, kv_len, str(device), tuple(block_size))
    with _implicit_lock:
        hit = _implicit.get(key)
        if hit is not None:
            ref, prepared = hit
            if ref is None or ref() is mask:
                _implicit.move_to_end(key)
                return prepared
            del _implicit[key]
    prepared = prepare(mask, q_len, kv_len, device=device, block_size=block_size)
    PREPARATIONS["count"] += 1
    ref = None if value_key is not None else weakref.ref(mask)
    with _implicit_lock:
        _implicit[key] = (ref, prepared)
        while len(_implicit) > IMPLICIT_CACHE_SIZE:
            _implicit.popitem(last=False)
    return prepared


def clear_cache() -> None:
    """Forget every implicitly prepared mask."""
    with _implicit_lock:
        _implicit.clear()
