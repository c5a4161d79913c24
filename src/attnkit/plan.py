"""``prepare``: a mask turned into the block lists kernels read, as an explicit value.

A :class:`PreparedMask` holds, per (sequence, head) of the mask and per row block of
``bq`` queries, the key blocks of ``bk`` keys that are not empty and which of them are
full, as tensors (``kv_num``, ``kv_indices``, ``kv_full``: the form a GPU kernel
reads, like FlexAttention's ``BlockMask``), the element masks of the partial blocks as
bits (``bits``, ``tile_ids``) and the facts kernels decide on (``band``, ``kept``,
``hides_nothing``, ...). Everything is computed once, here; a PreparedMask is a frozen value
and **the one truth of its mask**: every kernel reads its block lists and bits, and none
evaluates the mask (a ``from_fn`` predicate, say) again after preparation, so changing what
a predicate reads afterwards changes nothing a prepared mask gives.

Preparing reads the mask's values once (a host sync); reusing the prepared mask
across layers and decoding steps is the fast path::

    prepared = attnkit.prepare(masks.document(ids) & masks.causal(), L, L)
    for layer in layers:
        x = layer(x, mask=prepared)

``attnkit.attention`` also prepares masks it is given as mask objects, through one
bounded cache (:data:`attnkit._cache.PREPARED`): masks are found by value (their kind,
parameters and the contents of small tensors they hold); a mask whose value cannot be
keyed (a ``from_fn`` predicate over state that cannot be fingerprinted) is prepared again
on every call.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from attnkit import _cache
from attnkit import masks as _masks
from attnkit._bits import listed_tiles, partial_bits
from attnkit._types import Device
from attnkit._validate import AttnkitTypeError, AttnkitValueError, check_nonnegative_int, compiling

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "MaskFacts",
    "MaskLike",
    "PreparedMask",
    "clear_cache",
    "mask_facts",
    "prepare",
    "prepared_for",
    "rebuilt",
]

#: The block size ``prepare`` uses when none is asked for: the CPU kernels' (``benchmarks/cpu.py``).
#: Each kernel declares its own (:attr:`attnkit.kernels.Kernel.block_size`); the registry
#: prepares for the kernel it chooses.
DEFAULT_BLOCK_SIZE = (128, 64)


@dataclass(frozen=True)
class MaskFacts:
    """What a mask object says of itself at some lengths, without reading its values: the one
    place these facts are worked out, for a :class:`PreparedMask` and for a call that has not
    prepared its mask.

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


NO_MASK = MaskFacts(None, False)


def mask_facts(mask: _masks.Mask | None, q_len: int, kv_len: int) -> MaskFacts:
    """The :class:`MaskFacts` of a mask object (or of no mask) at these lengths."""
    if mask is None:
        return NO_MASK
    return MaskFacts(mask.band(q_len, kv_len), mask.limit_only())


_UIDS = itertools.count(1)


@dataclass(frozen=True, eq=False, kw_only=True)
class PreparedMask:
    """A mask prepared for ``Lq x Lk`` attention; pass it wherever a mask is accepted.

    Every field is computed by :func:`prepare` and read-only (``Bm``/``Hm``: the mask's batch
    and head sizes, 1 where it is the same for all; ``nq = ceil(Lq / bq)``, ``nk = ceil(Lk / bk)``):

    - ``codes (Bm, Hm, nq, nk) int8``: EMPTY / PARTIAL / FULL per block;
    - ``kv_num (Bm, Hm, nq) int32``: kept key blocks per row block;
    - ``kv_indices (Bm, Hm, nq, nk) int32``: their indices first, in order;
    - ``kv_full (Bm, Hm, nq, nk) bool``: whether each listed block is full;
    - ``kv_limit (Bm,) int64`` or None: keys from here on are hidden (never read); ``kv_limits``
      the same as Python ints (read once, at preparation);
    - ``bits (T, bk, ceil(bq / 8)) uint8``: the element masks of the partial blocks, key-major,
      eight queries a byte (bit ``r % 8`` of byte ``r // 8`` in key ``c``'s row is query ``r``;
      1 = may attend; one all-zero tile where there is no partial block);
    - ``tile_ids (Bm, Hm, nq, nk) int32``: for the j-th listed key block of each row block (the
      order of ``kv_indices``), its tile in ``bits``, or -1 for a full block;
    - ``kept``: the mean fraction of blocks a (sequence, head) visits; ``masked``: whether any
      block is partial (needs its element mask);
    - ``band``, ``causal_shift``, ``limit_only``: the mask's :class:`MaskFacts`;
    - ``hides_nothing``: every pair may attend at these lengths;
    - ``mask``: the mask it was prepared from (for its description and positions; never
      evaluated again), or None for a plan rebuilt from tensors;
    - ``uid``: a number unique to this prepared mask in the process.

    Kernels read these fields, never the mask's class. :meth:`to` returns a new one with its
    tensors moved.
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
    kv_limits: tuple[int, ...] | None
    bits: torch.Tensor = field(repr=False)
    tile_ids: torch.Tensor = field(repr=False)
    kept: float
    masked: bool
    band: tuple[int | None, int | None] | None = None
    limit_only: bool = False
    hides_nothing: bool = False
    uid: int = field(default_factory=lambda: next(_UIDS), repr=False, compare=False)
    #: forms derived on request (unpacked bits, a device's copies): written by this class only
    _derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def causal_shift(self) -> int | None:
        """``s`` when the mask is exactly "key j visible iff ``j <= i + s``" (0: SDPA's ``is_causal``)."""
        return MaskFacts(self.band, self.limit_only).causal_shift

    @property
    def kv_limit_value(self) -> int | None:
        """The key limit as a Python int when every sequence has the same one (None: no limit, or
        limits that differ), so a kernel can cut the keys without a sync."""
        limits = self.kv_limits
        if not limits or any(n != limits[0] for n in limits):
            return None
        return limits[0]

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
            bq, bk = self.block_size
            shifts = torch.arange(8, dtype=torch.uint8, device=self.bits.device)
            rows = (self.bits[..., None] >> shifts) & 1  # (T, bk, ceil(bq/8), 8)
            rows = rows.reshape(self.bits.shape[0], bk, -1)[:, :, :bq]  # (T, bk, bq)
            int8 = rows.transpose(1, 2).to(torch.int8)  # (T, bq, bk)
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

    def allowed_at(self, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """The allowed pairs of queries ``q_idx: (n,)`` and keys ``kv_idx: (S,)`` (indices in
        ``[0, Lq)`` and ``[0, Lk)``): ``(Bm, Hm, n, S)`` bool, read from the block codes, the
        partial blocks' bits and the key limits (the mask is not evaluated)."""
        bq, bk = self.block_size
        q_idx, kv_idx = q_idx.to(self.device).long(), kv_idx.to(self.device).long()
        bi, bj = q_idx // bq, kv_idx // bk
        codes = self.codes[:, :, bi][:, :, :, bj]  # (Bm, Hm, n, S)
        out = codes == _masks.FULL
        if self.masked:
            int8, _ = self.partial_bits()
            tiles = self.block_tiles()[:, :, bi][:, :, :, bj].clamp(min=0).long()
            bit = int8[tiles, (q_idx % bq)[:, None], (kv_idx % bk)[None, :]]  # (Bm, Hm, n, S)
            out = out | ((codes == _masks.PARTIAL) & (bit == 1))
        if self.kv_limit is not None:  # a full block may straddle a limit: keys past it are hidden
            out = out & (kv_idx[None, None, None, :] < self.kv_limit.view(-1, 1, 1, 1))
        return out

    def allowed(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """The allowed pairs of queries ``[q0, q1)`` and keys ``[k0, k1)``: ``(Bm, Hm, n, S)`` bool
        (see :meth:`allowed_at`)."""
        return self.allowed_at(torch.arange(q0, q1, device=self.device), torch.arange(k0, k1, device=self.device))

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
        """The same prepared mask with its tensors on ``device`` (a new value; this one is unchanged)."""
        device = torch.device(device) if device is not None else self.device
        if device == self.device:
            return self
        moved = {
            name: getattr(self, name).to(device)
            for name in ("codes", "kv_num", "kv_indices", "kv_full", "bits", "tile_ids")
        }
        limit = None if self.kv_limit is None else self.kv_limit.to(device)
        return PreparedMask(
            mask=self.mask, q_len=self.q_len, kv_len=self.kv_len, block_size=self.block_size, kv_limit=limit,
            kv_limits=self.kv_limits, kept=self.kept, masked=self.masked, band=self.band,
            limit_only=self.limit_only, hides_nothing=self.hides_nothing, **moved,
        )  # fmt: skip

    def with_block_size(self, block_size: tuple[int, int]) -> PreparedMask:
        """The same mask prepared for another block size: blocked again from this plan's own
        pairs (not from the mask), once per block size (through the implicit cache)."""
        if tuple(block_size) == self.block_size:
            return self
        return prepared_for(_Planned(self), self.q_len, self.kv_len, self.device, (block_size[0], block_size[1]))

    def materialize(self, device: Device = None) -> torch.Tensor:
        """The dense bool mask ``(Bm, Hm, Lq, Lk)`` (True = may attend), read from the plan."""
        device = device or self.device
        bm, hm = self.lead_shape
        if self.hides_nothing:
            return torch.ones(1, 1, self.q_len, self.kv_len, dtype=torch.bool, device=device)
        bq = self.block_size[0]
        keys = torch.arange(self.kv_len, device=self.device)
        if compiling():  # one expression over the lengths: a loop over them would fix them in the graph
            return self.allowed_at(torch.arange(self.q_len, device=self.device), keys).to(device)
        parts = [  # a row of blocks at a time: O(bq x Lk) index tensors
            self.allowed_at(torch.arange(q0, min(q0 + bq, self.q_len), device=self.device), keys)
            for q0 in range(0, self.q_len, bq)
        ]
        if not parts:
            return torch.zeros(bm, hm, 0, self.kv_len, dtype=torch.bool, device=device)
        return torch.cat(parts, dim=2).to(device)  # (Bm, Hm, Lq, Lk) (cat: inductor compiles it, slice writes not)

    def __repr__(self) -> str:
        bq, bk = self.block_size
        return (
            f"PreparedMask({self.mask!r}, Lq={self.q_len}, Lk={self.kv_len}, blocks={bq}x{bk}, "
            f"lead_shape={self.lead_shape}, kept={self.kept:.0%})"
        )


class _Planned(_masks.Mask):
    """A prepared mask read as a mask object (its pairs from the plan): what a PreparedMask is
    blocked again from at another block size, so the plan stays the one truth of the mask."""

    def __init__(self, prepared: PreparedMask):
        self.prepared = prepared
        self.batch_size = prepared.lead_shape[0] if prepared.lead_shape[0] > 1 else None

    def tensors(self):
        return (self.prepared.codes,)

    def value_key(self) -> Hashable:
        return ("prepared", self.prepared.uid)  # a PreparedMask never changes

    def lead_shape(self):
        return self.prepared.lead_shape

    def band(self, q_len, kv_len):
        return self.prepared.band

    def limit_only(self):
        return self.prepared.limit_only

    def key_limit(self):
        return self.prepared.kv_limit

    def positions(self, q_len, kv_len, device=None):
        mask = self.prepared.mask
        return None if mask is None else mask.positions(q_len, kv_len, device)

    def check(self, q_len, kv_len):
        if (q_len, kv_len) != (self.prepared.q_len, self.prepared.kv_len):
            raise AttnkitValueError(
                f"the prepared mask was prepared for Lq={self.prepared.q_len}, Lk={self.prepared.kv_len} but is "
                f"used with Lq={q_len}, Lk={kv_len}. Prepare it for these lengths."
            )

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        return self.prepared.allowed_at(q_idx.reshape(-1), kv_idx.reshape(-1))

    def block_codes(self, b):
        rows = []
        keys = torch.arange(b.keys, device=b.device)
        pad = -b.keys % b.bk
        for i in range(b.nq):  # one row of blocks at a time
            q_idx = torch.arange(i * b.bq, min((i + 1) * b.bq, b.q_len), device=b.device)
            e = self.prepared.allowed_at(q_idx, keys).view(torch.uint8)  # (Bm, Hm, n, Lk)
            lo, hi = e.amin(dim=-2), e.amax(dim=-2)
            lo = torch.nn.functional.pad(lo, (0, pad), value=1).view(*lo.shape[:2], -1, b.bk).amin(-1)
            hi = torch.nn.functional.pad(hi, (0, pad), value=0).view(*hi.shape[:2], -1, b.bk).amax(-1)
            rows.append(b.code(lo == 1, hi == 0))
        if not rows:
            return torch.zeros(1, 1, 0, b.nk, dtype=torch.int8, device=b.device)
        return torch.stack(rows, dim=-2)

    def __repr__(self):
        return repr(self.prepared.mask) if self.prepared.mask is not None else "plan rebuilt from tensors"


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
    and the partial blocks' bits on ``device`` (default: the mask's own). Reuse it for every
    call with these lengths: no further host syncs, and the mask is never evaluated again.

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
        # one evaluation for the codes and the partial blocks' bits where the mask has it (a from_fn program)
        found = mask.codes_with_tiles(q_len, kv_len, bq, bk, device) if limit is None else None
        if found is not None:
            codes, tiles = found[0].contiguous(), found[1:]
            return _assemble(mask, q_len, kv_len, (bq, bk), codes, limit, mask_facts(mask, q_len, kv_len), None, tiles)
        codes = mask._block_map(q_len, kv_len, bq, bk, device, limit).contiguous()
    return _assemble(mask, q_len, kv_len, (bq, bk), codes, limit, mask_facts(mask, q_len, kv_len), None)


def _assemble(
    mask, q_len, kv_len, block_size, codes, limit, facts: MaskFacts, bits_and_ids, tiles=None
) -> PreparedMask:
    """A PreparedMask from its block codes: the block lists, bits and facts (``tiles``: the partial
    blocks and their bits, where the mask made them with the codes)."""
    kept_blocks = codes != _masks.EMPTY
    order = torch.argsort((~kept_blocks).to(torch.int8), dim=-1, stable=True)
    kv_num = kept_blocks.sum(-1, dtype=torch.int32).contiguous()
    kv_indices = order.to(torch.int32).contiguous()
    kv_full = torch.gather(codes, -1, order) == _masks.FULL
    kept = float(kept_blocks.float().mean()) if codes.numel() else 0.0
    limits = None if limit is None else tuple(int(n) for n in limit.cpu().reshape(-1).tolist())
    masked = bool((codes == _masks.PARTIAL).any())
    if tiles is not None:
        bits, tile_ids = listed_tiles(codes, kv_indices, *tiles)
    elif bits_and_ids is None:
        bits, tile_ids = partial_bits(mask, q_len, kv_len, block_size, codes, kv_indices)
    else:
        bits, tile_ids = bits_and_ids
    if "torch._dynamo" in sys.modules:  # torch.compile in use: another layout's number of
        torch._dynamo.maybe_mark_dynamic(bits, 0)  # partial tiles runs the same compiled graph
        # a tile's sizes follow the block size alone: static, so that dynamic=True's duck sizing
        # never ties them to a length's block count (a guard a new length would fail)
        torch._dynamo.mark_static(bits, 1)
        torch._dynamo.mark_static(bits, 2)
    return PreparedMask(
        mask=mask,
        q_len=q_len,
        kv_len=kv_len,
        block_size=tuple(block_size),
        codes=codes,
        kv_num=kv_num,
        kv_indices=kv_indices,
        kv_full=kv_full,
        kv_limit=limit,
        kv_limits=limits,
        bits=bits,
        tile_ids=tile_ids,
        kept=kept,
        masked=masked,
        band=facts.band,
        limit_only=facts.limit_only,
        hides_nothing=bool(kept == 1.0 and not masked and limit is None),
    )


def rebuilt(
    q_len: int,
    kv_len: int,
    block_size: tuple[int, int],
    codes: torch.Tensor,
    kv_limit: torch.Tensor | None,
    bits: torch.Tensor,
    tile_ids: torch.Tensor,
    band: tuple[int | None, int | None] | None,
    limit_only: bool = False,
) -> PreparedMask:
    """A PreparedMask from the tensors of one (the plan compiled code carries as arguments)."""
    facts = MaskFacts(band, limit_only)
    return _assemble(None, q_len, kv_len, tuple(block_size), codes, kv_limit, facts, (bits, tile_ids))


# --- the implicit cache ---------------------------------------------------------------


#: How many preparations the implicit cache has made (tests count them).
PREPARATIONS = {"count": 0}


def prepared_for(
    mask: _masks.Mask | None, q_len: int, kv_len: int, device: Device, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE
) -> PreparedMask:
    """``prepare(mask, q_len, kv_len, device=device, block_size=block_size)`` through the
    bounded implicit cache (:data:`attnkit._cache.PREPARED`): once per (mask value, lengths,
    device, block size).

    Masks are found by value (:meth:`attnkit.masks.Mask.value_key`: kind, parameters and the
    contents of small tensors); a mask whose value cannot be keyed but that never changes
    (:meth:`~attnkit.masks.Mask.cacheable`: large tensors it holds copies of) by identity, held
    weakly and checked; any other (a predicate over state that cannot be fingerprinted) is
    prepared again on each call.
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
