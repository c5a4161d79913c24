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

import copy
import numbers
from collections.abc import Callable, Hashable, Sequence

import torch

from attnkit import _cache
from attnkit._indexing import as4d, check_align, check_offset, fmt, own, per_seq, shifted, span
from attnkit._types import Device, IntLike, Offset
from attnkit._validate import (
    AttnkitTypeError,
    AttnkitValueError,
    check_int_tensor,
    check_nonnegative_int,
    short,
)

__all__ = [
    "Mask",
    "causal",
    "sliding_window",
    "prefix_lm",
    "document",
    "padding",
    "dense",
    "from_fn",
    "cached",
    "as_mask",
    "EMPTY",
    "PARTIAL",
    "FULL",
]

#: Block-map codes: no pair of the block may attend / some may / all may.
EMPTY, PARTIAL, FULL = 0, 1, 2


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Positions ``(..., L)`` with per-sequence leading dims as ``(B or 1, L)``."""
    return t.reshape(-1, t.shape[-1])


def _indexed_positions(q_offset, kv_offset, q_len: int, kv_len: int, device):
    """``(q_idx + q_offset, kv_idx + kv_offset)`` as ``(B or 1, L)``: masks whose indices are positions."""
    q = torch.arange(q_len, device=device)[None, :] + per_seq(q_offset, device, 2)
    k = torch.arange(kv_len, device=device)[None, :] + per_seq(kv_offset, device, 2)
    return q, k


#: Tensors of at most this many elements (on the CPU) are part of a mask's value key.
KEY_ELEMENTS = 1 << 16


def _value(x):
    """A hashable stand-in for an int or a small CPU tensor (None: too large to key by value)."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.device.type != "cpu" or x.numel() > KEY_ELEMENTS:
        return None
    if x.dim() == 1 and x.numel() <= 64:  # a decoding step's lengths: tolist is 3x faster than a byte copy
        return (x.shape, x.dtype, tuple(x.tolist()))
    return (tuple(x.shape), x.dtype, x.contiguous().numpy().tobytes())


def _values(*xs):
    """``tuple(_value(x) for x in xs)``, or None if one cannot be keyed."""
    out = []
    for x in xs:
        value = _value(x)
        if value is None and x is not None:
            return None
        out.append(value)
    return tuple(out)


def _batch_of(*values) -> int | None:
    """The batch size implied by per-sequence tensors among ``values`` (None if none)."""
    sizes = {v.shape[0] for v in values if isinstance(v, torch.Tensor) and v.shape[0] != 1}
    if len(sizes) > 1:
        raise AttnkitValueError(f"per-sequence arguments have different batch sizes {sorted(sizes)}.")
    return sizes.pop() if sizes else None


class _Positional:
    """Offsets and alignment shared by the masks defined by positions."""

    align: str = "bottom_right"
    q_offset = 0
    kv_offset = 0

    def _set_positions(self, align, q_offset, kv_offset):
        self.align = check_align(align)
        self.q_offset = check_offset(q_offset, "q_offset")
        self.kv_offset = check_offset(kv_offset, "kv_offset")

    def _q_pos(self, q_idx, q_len, kv_len):
        """Key-axis position of each query index (``kv_len`` may be a per-sequence tensor)."""
        p = q_idx + per_seq(self.q_offset, q_idx.device)
        return p + (kv_len - q_len) if self.align == "bottom_right" else p

    def _k_pos(self, kv_idx):
        return kv_idx + per_seq(self.kv_offset, kv_idx.device)

    def positions(self, q_len, kv_len, device=None):
        if device is None:
            device = self._device()
        q_pos = self._q_pos(torch.arange(q_len, device=device)[None, :], q_len, kv_len)  # (B or 1, Lq)
        k_pos = self._k_pos(torch.arange(kv_len, device=device)[None, :])  # (B or 1, Lk)
        return _rows(q_pos), _rows(k_pos)

    def _position_repr(self) -> str:
        extra = f"align={self.align!r}"
        if not (isinstance(self.q_offset, int) and self.q_offset == 0):
            extra += f", q_offset={fmt(self.q_offset)}"
        if not (isinstance(self.kv_offset, int) and self.kv_offset == 0):
            extra += f", kv_offset={fmt(self.kv_offset)}"
        return extra

    def _index_shift(self, q_len, kv_len) -> int | None:
        """``p(i) - k(j) - (i - j)``: the key index query i sits at, minus i (None: per-sequence offsets)."""
        if self._position_key() is None:
            return None
        return self.q_offset - self.kv_offset + (kv_len - q_len if self.align == "bottom_right" else 0)

    def _position_key(self):
        """Alignment and int offsets (None with per-sequence offsets: see :meth:`_position_value`)."""
        if isinstance(self.q_offset, torch.Tensor) or isinstance(self.kv_offset, torch.Tensor):
            return None
        return (self.align, self.q_offset, self.kv_offset)

    def _position_value(self):
        """Alignment and offsets, tensors by value where small (None where they cannot be keyed)."""
        offsets = _values(self.q_offset, self.kv_offset)
        return None if offsets is None else (self.align, *offsets)

    def _position_tensors(self):
        return tuple(x for x in (self.q_offset, self.kv_offset) if isinstance(x, torch.Tensor))

    def tensors(self):
        return self._position_tensors()

    def _part(self, q_start, kv_start, q_len, kv_len, q_count, kv_count):
        # In the part, positions are the global ones: keys move by kv_start, queries by
        # q_start (plus the bottom-right shift of the whole problem), aligned top-left.
        other = copy.copy(self)
        shift = q_start + (kv_len - q_len if self.align == "bottom_right" else 0)
        other.align = "top_left"
        other.q_offset = shifted(self.q_offset, shift)
        other.kv_offset = shifted(self.kv_offset, kv_start)
        return other

    def _block_positions(self, b):
        """Query positions of each block's first and last row, key positions of its first and last key."""
        p_lo, p_hi = self._q_pos(b.q_lo, b.q_len, b.kv_len), self._q_pos(b.q_hi, b.q_len, b.kv_len)
        return p_lo, p_hi, self._k_pos(b.k_lo), self._k_pos(b.k_hi)


class Blocks:
    """Index ranges of every (query block, key block) pair.

    ``q_lo/q_hi`` ``(nq, 1)`` are the first and last query index of each query block;
    ``k_lo/k_hi`` ``(1, nk)`` (or ``(B, 1, 1, nk)`` when ``kv_limit`` is given) the first
    and last key index of each key block. ``kv_limit: (B,)`` says that keys from
    ``kv_limit[b]`` on are hidden for sequence b, so blocks are judged on the keys
    before it only.
    """

    def __init__(
        self, q_len: int, kv_len: int, bq: int, bk: int, device: Device = None, kv_limit: torch.Tensor | None = None
    ):
        self.q_len, self.kv_len, self.bq, self.bk = q_len, kv_len, bq, bk
        self.keys = kv_len  # how many keys there are (kv_len may become per-sequence, for positions)
        self.nq, self.nk = -(-q_len // bq), -(-kv_len // bk)
        self.device = device
        q0 = torch.arange(self.nq, device=device) * bq
        k0 = torch.arange(self.nk, device=device) * bk
        self.q_lo, self.q_hi = q0[:, None], (q0 + bq).clamp(max=q_len)[:, None] - 1
        self.k_lo, self.k_hi = k0[None, :], (k0 + bk).clamp(max=kv_len)[None, :] - 1
        if kv_limit is not None:
            self.k_hi = torch.minimum(self.k_hi, kv_limit.to(device).view(-1, 1, 1, 1) - 1)

    def with_kv_len(self, kv_len: IntLike) -> Blocks:  # per-sequence lengths: a (B, 1, 1, 1) tensor
        """The same blocks with another (per-sequence) key length for the positions (``keys`` stays)."""
        other = object.__new__(Blocks)
        other.__dict__.update(self.__dict__)
        other.kv_len = kv_len  # type: ignore[assignment]  # per-sequence: a (B, 1, 1, 1) tensor
        return other

    def code(self, full: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
        """int8 codes (..., nq, nk) from bool "every pair allowed" / "no pair allowed"."""
        full, empty = torch.broadcast_tensors(full, empty)
        out = torch.full(full.shape, PARTIAL, dtype=torch.int8, device=full.device)
        return out.masked_fill_(full, FULL).masked_fill_(empty, EMPTY)


def _block_minmax(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block min and max over the last dim of ``x: (B, L)`` -> (B, ceil(L / block))."""
    length = x.shape[-1]
    pad = -length % block
    if pad:
        last = x[..., -1:].expand(*x.shape[:-1], pad)  # repeating the last entry changes no min/max
        x = torch.cat([x, last], dim=-1)
    blocks = x.view(*x.shape[:-1], -1, block)
    return blocks.amin(-1), blocks.amax(-1)


class Mask:
    """A pattern of allowed (query, key) pairs; True means "may attend".

    Subclasses define :meth:`_elements`, which evaluates the pattern on any set of
    query and key indices (so kernels evaluate one tile at a time and
    :meth:`materialize` is the tile that covers everything), and :meth:`_block_codes`,
    which classifies blocks from their index ranges.
    """

    #: Number of sequences the mask is specific to (None: the same for every sequence).
    batch_size: int | None = None

    def elements(self, q_idx: torch.Tensor, kv_idx: torch.Tensor, q_len: int, kv_len: IntLike) -> torch.Tensor:
        """Allowed pairs for ``q_idx: (tq, 1)`` and ``kv_idx: (1, tk)``.

        Returns a bool tensor of shape ``(B or 1, H or 1, tq, tk)``.
        """
        raise NotImplementedError

    def block_codes(self, blocks: Blocks) -> torch.Tensor:
        """Codes ``(..., nq, nk)`` for the block ranges; see :meth:`block_map`."""
        raise NotImplementedError

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors the mask holds (its own copies)."""
        return ()

    def _device(self) -> torch.device | None:
        """The device of the tensors the mask holds (None if it holds none)."""
        held = self.tensors()
        return held[0].device if held else None

    def value_key(self) -> Hashable | None:
        """A hashable value that determines the mask (its kind, parameters and the values of
        the small CPU tensors it holds), or None where only its identity can (large or device
        tensors, dense masks). Equal keys mean equal masks: the implicit cache of
        :mod:`attnkit.prepare` prepares them once (e.g. the cache masks of every layer of a
        decoding step)."""
        return None

    def cacheable(self) -> bool:
        """Whether a result made from this mask may be kept by the mask's identity when it has no
        :meth:`value_key` (masks copy the tensors they hold, so they never change; a ``from_fn``
        predicate over something that cannot be fingerprinted might, and is never kept)."""
        return True

    def band(self, q_len: int, kv_len: int) -> tuple[int | None, int | None] | None:
        """``(lo, hi)`` when this mask is exactly the band ``lo <= j - i <= hi`` of query index i
        and key index j at these lengths (None for a side without bound), else None.

        Causal and sliding-window masks with int offsets are bands, and so are their
        ``&``: a kernel can evaluate them from two numbers, without reading the mask.
        ``(None, 0)`` is SDPA's ``is_causal=True``.

        >>> causal().band(3, 5), sliding_window(2, 1).band(4, 4)
        ((None, 2), (-2, 1))
        """
        return None

    def limit_only(self) -> bool:
        """Whether this mask hides exactly the keys from :meth:`key_limit` on (padding,
        empty cache slots): a kernel can read each sequence's first keys and skip the mask."""
        return False

    def positions(self, q_len: int, kv_len: int, device: Device = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Key-axis positions of the queries and keys: ``(q_pos (B or 1, Lq), k_pos (B or 1, Lk))``.

        Query i sits at ``q_pos[b, i]`` and key j at ``k_pos[b, j]`` on one axis (the
        positions the mask's formula compares; what ``mean_distance`` in
        :func:`attnkit.inspect.attention_stats` measures). None for masks that do not
        place queries (padding, dense masks): the caller then uses bottom-right
        alignment, ``q_pos = i + Lk - Lq``.

        >>> causal().positions(2, 4)
        (tensor([[2, 3]]), tensor([[0, 1, 2, 3]]))
        """
        return None

    def _in_cache(self, start: torch.Tensor) -> Mask:
        """This mask for queries that sit at key positions ``start[b] + i`` (a KV cache).

        Positional masks align through the per-sequence key length :class:`_Cached` gives
        them; masks whose indices *are* positions (``from_fn``, documents) move their
        query offsets by ``start`` here. Dense masks are for the call's shape as given.
        """
        return self

    def key_limit(self) -> torch.Tensor | None:
        """``(B or 1,)`` tensor: keys from ``limit[b]`` on are hidden for every query of b.

        None when the mask has no such limit. Kernels never read keys past it.
        """
        return None

    def lead_shape(self) -> tuple[int, int]:
        """``(B or 1, H or 1)``: the batch and head sizes of :meth:`materialize`'s result."""
        return (self.batch_size or 1, 1)

    def check(self, q_len: int, kv_len: int) -> None:
        """Raise ``ValueError`` if this mask's shapes do not fit these lengths (no host sync)."""

    def check_values(self, q_len: int, kv_len: int) -> None:
        """Raise ``ValueError`` if the values the mask holds do not fit (may read them)."""

    def materialize(self, q_len: int, kv_len: int, device: Device = None, *, check: bool = True) -> torch.Tensor:
        """The dense bool mask, shape ``(B or 1, H or 1, Lq, Lk)``; True = may attend.

        ``check=False`` skips the checks that read the mask's values (a host sync), so
        traced code (``torch.compile``) can call it.

        Equivalent pytorch code for ``causal()``:
        ``torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)[None, None]``.
        """
        if check:
            q_len = check_nonnegative_int(q_len, "q_len")
            kv_len = check_nonnegative_int(kv_len, "kv_len")
            self.check(q_len, kv_len)
            self.check_values(q_len, kv_len)
        return self._dense(q_len, kv_len, device)

    def _dense(self, q_len: int, kv_len: int, device=None) -> torch.Tensor:
        """:meth:`materialize` without checks (traceable by ``torch.compile``)."""
        if device is None:
            device = self._device()
        q_idx = torch.arange(q_len, device=device)[:, None]
        kv_idx = torch.arange(kv_len, device=device)[None, :]
        out = as4d(self.elements(q_idx, kv_idx, q_len, kv_len))
        return out.expand(*out.shape[:2], q_len, kv_len)

    def block_map(self, q_len: int, kv_len: int, bq: int, bk: int, device: Device = None) -> torch.Tensor:
        """Classify every ``bq x bk`` block: ``(B or 1, H or 1, ceil(Lq/bq), ceil(Lk/bk))`` int8.

        Codes: ``EMPTY`` (0, no pair may attend), ``PARTIAL`` (1) and ``FULL`` (2, every
        pair may attend). Computed from the blocks' index ranges, never from an
        ``Lq x Lk`` tensor (dense masks are reduced block by block, ``from_fn`` masks
        are evaluated one row of blocks at a time). EMPTY and FULL are always exact;
        PARTIAL may be reported for a block that is in fact empty or full where that
        cannot be known cheaply (combinations, unsorted document ids).

        >>> causal().block_map(4, 4, 2, 2)[0, 0].tolist()
        [[1, 0], [2, 1]]
        """
        q_len = check_nonnegative_int(q_len, "q_len")
        kv_len = check_nonnegative_int(kv_len, "kv_len")
        self.check(q_len, kv_len)
        self.check_values(q_len, kv_len)
        return self._block_map(q_len, kv_len, bq, bk, device)

    def _block_map(self, q_len, kv_len, bq, bk, device=None, kv_limit=None) -> torch.Tensor:
        if device is None:
            device = self._device()
        blocks = Blocks(q_len, kv_len, bq, bk, device, kv_limit)
        codes = self.block_codes(blocks)
        if kv_limit is not None:  # blocks wholly past a sequence's limit hold nothing
            codes = codes.masked_fill(blocks.k_lo >= kv_limit.to(device).view(-1, 1, 1, 1), EMPTY)
        codes = as4d(codes)
        return codes.expand(*codes.shape[:2], blocks.nq, blocks.nk)

    def picture(self, q_len: int, kv_len: int, *, batch: int = 0, head: int = 0) -> str:
        """The mask as rows of ``1`` (may attend) and ``0`` (hidden), one row per query."""
        m = self.materialize(q_len, kv_len)
        for name, index, size in (("batch", batch, m.shape[0]), ("head", head, m.shape[1])):
            if isinstance(index, bool) or not isinstance(index, int):
                raise AttnkitTypeError(f"{name} must be an int, but got {short(index)}.")
            if not (0 <= index < size or size == 1 and index >= 0):
                raise AttnkitValueError(f"{name}={index} is out of range: this mask has {size} (0..{size - 1}).")
        m = m[min(batch, m.shape[0] - 1), min(head, m.shape[1] - 1)]
        return "\n".join(" ".join("1" if x else "0" for x in row) for row in m.tolist())

    def part(self, q_len: int, kv_len: int, q: slice = slice(None), kv: slice = slice(None)) -> Mask:
        """The same pattern on a rectangle of a ``(q_len, kv_len)`` problem, as a mask of its own.

        ``m.part(Lq, Lk, q=slice(a, b), kv=slice(c, d)).materialize(b - a, d - c)`` equals
        ``m.materialize(Lq, Lk)[..., a:b, c:d]``. The part is another mask object of the
        same kind, with its offsets moved (a dense mask is sliced), so it keeps its block
        structure: this is how a shard of a sequence, or a chunk of queries, keeps the
        global mask exactly (:mod:`attnkit.distributed`).

        >>> print(causal().part(4, 4, q=slice(2, 4), kv=slice(0, 2)).picture(2, 2))
        1 1
        1 1
        """
        q_len = check_nonnegative_int(q_len, "q_len")
        kv_len = check_nonnegative_int(kv_len, "kv_len")
        (q0, q1), (k0, k1) = span(q, q_len, "q"), span(kv, kv_len, "kv")
        self.check(q_len, kv_len)
        return self._part(q0, k0, q_len, kv_len, q1 - q0, k1 - k0)

    def _part(self, q_start: int, kv_start: int, q_len: int, kv_len, q_count: int, kv_count: int) -> Mask:
        """:meth:`part` without checks: rows ``q_start + [0, q_count)``, keys ``kv_start + [0, kv_count)``."""
        raise AttnkitValueError(f"{self!r} cannot be split into parts.")

    def __and__(self, other) -> Mask:
        return _Combine("&", self, as_mask(other))

    def __rand__(self, other) -> Mask:
        return _Combine("&", as_mask(other), self)

    def __or__(self, other) -> Mask:
        return _Combine("|", self, as_mask(other))

    def __ror__(self, other) -> Mask:
        return _Combine("|", as_mask(other), self)


class _Causal(_Positional, Mask):
    def __init__(self, align: str, q_offset=0, kv_offset=0):
        self._set_positions(align, q_offset, kv_offset)
        self.batch_size = _batch_of(self.q_offset, self.kv_offset)

    def value_key(self):
        key = self._position_value()
        return None if key is None else ("causal", key)

    def band(self, q_len, kv_len):
        shift = self._index_shift(q_len, kv_len)  # key j is visible iff j <= i + shift
        return None if shift is None else (None, shift)

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        return as4d(self._k_pos(kv_idx) <= self._q_pos(q_idx, q_len, kv_len))

    def block_codes(self, b):
        p_lo, p_hi, k_lo, k_hi = self._block_positions(b)
        return b.code(full=k_hi <= p_lo, empty=k_lo > p_hi)

    def __repr__(self):
        return f"causal({self._position_repr()})"


class _SlidingWindow(_Positional, Mask):
    def __init__(self, left: int, right: int, align: str, q_offset=0, kv_offset=0):
        self.left = check_nonnegative_int(left, "left")
        self.right = check_nonnegative_int(right, "right")
        self._set_positions(align, q_offset, kv_offset)
        self.batch_size = _batch_of(self.q_offset, self.kv_offset)

    def value_key(self):
        key = self._position_value()
        return None if key is None else ("window", self.left, self.right, key)

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        p, j = self._q_pos(q_idx, q_len, kv_len), self._k_pos(kv_idx)
        return as4d((j >= p - self.left) & (j <= p + self.right))

    def block_codes(self, b):
        p_lo, p_hi, k_lo, k_hi = self._block_positions(b)
        full = (k_lo >= p_hi - self.left) & (k_hi <= p_lo + self.right)
        empty = (k_hi < p_lo - self.left) | (k_lo > p_hi + self.right)
        return b.code(full, empty)

    def band(self, q_len, kv_len):
        shift = self._index_shift(q_len, kv_len)
        return None if shift is None else (shift - self.left, shift + self.right)

    def __repr__(self):
        return f"sliding_window(left={self.left}, right={self.right}, {self._position_repr()})"


class _PrefixLM(_Positional, Mask):
    def __init__(self, prefix_len, align: str, q_offset=0, kv_offset=0):
        if isinstance(prefix_len, torch.Tensor):
            prefix_len = own(check_int_tensor(prefix_len, "prefix_len", (1,)))
            if prefix_len.device.type == "cpu" and (prefix_len < 0).any():
                raise AttnkitValueError(f"prefix_len must be >= 0, but got {short(prefix_len.tolist())}.")
        elif isinstance(prefix_len, numbers.Integral) and not isinstance(prefix_len, bool):
            prefix_len = check_nonnegative_int(int(prefix_len), "prefix_len")
        else:
            prefix_len = check_nonnegative_int(prefix_len, "prefix_len")
        self.prefix_len = prefix_len
        self._set_positions(align, q_offset, kv_offset)
        self.batch_size = _batch_of(prefix_len, self.q_offset, self.kv_offset)

    def tensors(self):
        own = (self.prefix_len,) if isinstance(self.prefix_len, torch.Tensor) else ()
        return own + self._position_tensors()

    def value_key(self):
        key, prefix = self._position_value(), _value(self.prefix_len)
        return None if key is None or prefix is None else ("prefix", prefix, key)

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        j = self._k_pos(kv_idx)
        causal = j <= self._q_pos(q_idx, q_len, kv_len)
        return as4d((j < per_seq(self.prefix_len, kv_idx.device)) | causal)

    def block_codes(self, b):
        prefix = per_seq(self.prefix_len, b.device)
        p_lo, p_hi, k_lo, k_hi = self._block_positions(b)
        full = (k_hi < prefix) | (k_hi <= p_lo)
        empty = (k_lo >= prefix) & (k_lo > p_hi)
        return b.code(full, empty)

    def __repr__(self):
        return f"prefix_lm(prefix_len={fmt(self.prefix_len)}, {self._position_repr()})"


class _Document(Mask):
    def __init__(self, ids, q_offset=0, kv_offset=0):
        ids = check_int_tensor(ids, "ids", (1, 2))
        self.ids = own(ids if ids.dim() == 2 else ids[None])  # (B or 1, L)
        self.q_offset = check_offset(q_offset, "q_offset")
        self.kv_offset = check_offset(kv_offset, "kv_offset")
        self.batch_size = _batch_of(self.ids, self.q_offset, self.kv_offset)

    def tensors(self):
        return (self.ids,) + tuple(x for x in (self.q_offset, self.kv_offset) if isinstance(x, torch.Tensor))

    def value_key(self):
        values = _values(self.ids, self.q_offset, self.kv_offset)
        return None if values is None else ("document", self.is_part, values)

    is_part = False

    def check(self, q_len, kv_len):
        length = self.ids.shape[-1]
        plain = all(isinstance(x, int) and x == 0 for x in (self.q_offset, self.kv_offset))
        if plain and not self.is_part and (q_len != length or kv_len != length):
            raise AttnkitValueError(
                f"document mask was built for sequences of length L={length} but is used with "
                f"Lq={q_len}, Lk={kv_len}. A document mask is for self-attention over the "
                "packed sequence: pass ids with one entry per token (or q_offset/kv_offset "
                "for a part of it)."
            )

    def check_values(self, q_len, kv_len):
        length = self.ids.shape[-1]
        for name, off, n in (("q_offset", self.q_offset, q_len), ("kv_offset", self.kv_offset, kv_len)):
            off = torch.as_tensor(off).reshape(-1)
            lo, hi = (int(off.min()), int(off.max())) if off.numel() else (0, 0)
            if lo < 0 or hi + n > length:
                raise AttnkitValueError(
                    f"document mask holds ids for L={length} tokens, but {name} in [{lo}, {hi}] "
                    f"with {n} positions reaches past them."
                )

    def _part(self, q_start, kv_start, q_len, kv_len, q_count, kv_count):
        other = copy.copy(self)
        other.q_offset = shifted(self.q_offset, q_start)
        other.kv_offset = shifted(self.kv_offset, kv_start)
        other.is_part = True
        return other

    def positions(self, q_len, kv_len, device=None):
        return _indexed_positions(self.q_offset, self.kv_offset, q_len, kv_len, device or self.ids.device)

    def _in_cache(self, start):
        other = self._part(0, 0, 0, 0, 0, 0)
        other.q_offset = self.q_offset + start  # (B,): query i of sequence b is token start[b] + i
        other.batch_size = _batch_of(self.ids, other.q_offset, self.kv_offset)
        return other

    def _ids_at(self, offset, idx: torch.Tensor) -> torch.Tensor:
        """ids of positions ``idx + offset``: ``(B or 1, n)``."""
        ids = self.ids.to(idx.device)
        pos = idx.reshape(1, -1) + per_seq(offset, idx.device, 2)
        pos = pos.expand(ids.shape[0], -1) if pos.shape[0] == 1 else pos
        ids = ids.expand(pos.shape[0], -1) if ids.shape[0] == 1 else ids
        return torch.gather(ids, 1, pos.clamp(0, ids.shape[-1] - 1))

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        qi = self._ids_at(self.q_offset, q_idx[:, 0])  # (B, tq)
        ki = self._ids_at(self.kv_offset, kv_idx[0])  # (B, tk)
        return (qi[:, :, None] == ki[:, None, :])[:, None]  # (B, 1, tq, tk)

    def block_codes(self, b):
        dev = b.device
        plain = all(isinstance(x, int) and x == 0 for x in (self.q_offset, self.kv_offset))
        if plain and b.q_len == b.keys == self.ids.shape[-1]:
            ids = self.ids.to(dev)
            q_ids = k_ids = ids
        else:
            q_ids = self._ids_at(self.q_offset, torch.arange(b.q_len, device=dev))
            k_ids = self._ids_at(self.kv_offset, torch.arange(b.keys, device=dev))
        q_min, q_max = _block_minmax(q_ids, b.bq)  # (B, nq)
        k_min, k_max = _block_minmax(k_ids, b.bk)  # (B, nk)
        q_min, q_max = q_min[:, None, :, None], q_max[:, None, :, None]  # (B, 1, nq, 1)
        k_min, k_max = k_min[:, None, None, :], k_max[:, None, None, :]  # (B, 1, 1, nk)
        full = (q_min == q_max) & (k_min == k_max) & (q_min == k_min)
        empty = (q_max < k_min) | (k_max < q_min)  # id ranges that cannot meet
        return b.code(full, empty)

    def __repr__(self):
        ids = self.ids if self.ids.shape[0] > 1 else self.ids[0]
        extra = "".join(
            f", {name}={fmt(x)}"
            for name, x in (("q_offset", self.q_offset), ("kv_offset", self.kv_offset))
            if not (isinstance(x, int) and x == 0)
        )
        return f"document(ids of shape {tuple(ids.shape)}{extra})"


class _Padding(Mask):
    def __init__(self, lengths, kv_offset=0):
        if lengths is None or isinstance(lengths, (str, bytes)):
            raise AttnkitTypeError(
                f"lengths must be a sequence of ints or an integer tensor of shape (B,), but got {short(lengths)}."
            )
        lengths = own(check_int_tensor(lengths, "lengths", (1,)))
        if lengths.device.type == "cpu" and (lengths < 0).any():
            raise AttnkitValueError(f"lengths must be >= 0, but got {short(lengths.tolist())}.")
        self.lengths = lengths
        self.kv_offset = check_offset(kv_offset, "kv_offset")
        self.batch_size = _batch_of(self.lengths, self.kv_offset) or lengths.shape[0]

    def tensors(self):
        return (self.lengths,) + ((self.kv_offset,) if isinstance(self.kv_offset, torch.Tensor) else ())

    def value_key(self):
        values = _values(self.lengths, self.kv_offset)
        return None if values is None else ("padding", self.is_part, values)

    is_part = False

    def check_values(self, q_len, kv_len):
        if self.is_part or isinstance(self.kv_offset, torch.Tensor) or self.kv_offset:
            return  # a shard of the keys: lengths count from the sequence's start
        longest = int(self.lengths.max()) if self.lengths.numel() else 0
        if longest > kv_len:
            raise AttnkitValueError(
                f"padding mask has a sequence of length {longest} but the keys have only "
                f"Lk={kv_len} positions. lengths must be <= Lk."
            )

    def _part(self, q_start, kv_start, q_len, kv_len, q_count, kv_count):
        other = copy.copy(self)
        other.kv_offset = shifted(self.kv_offset, kv_start)
        other.is_part = True  # lengths may reach past the part's keys
        return other

    def key_limit(self):
        return self.lengths - self.kv_offset

    def limit_only(self):
        return True

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        lengths = self.lengths.to(kv_idx.device)[:, None, None, None]  # (B, 1, 1, 1)
        return kv_idx + per_seq(self.kv_offset, kv_idx.device) < lengths  # (B, 1, 1, tk)

    def block_codes(self, b):
        lengths = self.lengths.to(b.device)[:, None, None, None]  # (B, 1, 1, 1)
        off = per_seq(self.kv_offset, b.device)
        return b.code(full=b.k_hi + off < lengths, empty=b.k_lo + off >= lengths)

    def __repr__(self):
        extra = "" if isinstance(self.kv_offset, int) and self.kv_offset == 0 else f", kv_offset={fmt(self.kv_offset)}"
        return f"padding(lengths={short(self.lengths.tolist())}{extra})"


class _Dense(Mask):
    def __init__(self, tensor: torch.Tensor):
        if not isinstance(tensor, torch.Tensor):
            raise AttnkitTypeError(f"a dense mask must be a torch.Tensor, but got {type(tensor).__name__}.")
        if tensor.dtype != torch.bool:
            raise AttnkitTypeError(
                f"a dense mask must be bool (True = may attend), but got {tensor.dtype}. "
                "Use mask != 0 to convert a 0/1 mask."
            )
        if tensor.dim() > 4:
            raise AttnkitValueError(
                "a dense mask must have at most 4 dimensions (B, H, Lq, Lk), aligned from the "
                f"right like scaled_dot_product_attention's attn_mask, but got {tuple(tensor.shape)}."
            )
        while tensor.dim() < 2:
            tensor = tensor[None]
        self.tensor = as4d(own(tensor))  # (B or 1, H or 1, Lq or 1, Lk or 1), a copy: masks are values
        self.batch_size = self.tensor.shape[0] if self.tensor.shape[0] != 1 else None

    def tensors(self):
        return (self.tensor,)

    def lead_shape(self):
        return tuple(self.tensor.shape[:2])

    def check(self, q_len, kv_len):
        tq, tk = self.tensor.shape[-2:]
        if tq not in (1, q_len) or tk not in (1, kv_len):
            raise AttnkitValueError(
                f"dense mask of shape {tuple(self.tensor.shape)} was built for Lq={tq}, "
                f"Lk={tk} but is used with Lq={q_len}, Lk={kv_len}."
            )

    def _part(self, q_start, kv_start, q_len, kv_len, q_count, kv_count):
        t = self.tensor
        if t.shape[-2] != 1:
            t = t[..., q_start : q_start + q_count, :]
        if t.shape[-1] != 1:
            t = t[..., kv_start : kv_start + kv_count]
        return _Dense(t)

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        t = self.tensor.to(q_idx.device)
        rows = q_idx if t.shape[-2] != 1 else torch.zeros_like(q_idx)
        cols = kv_idx if t.shape[-1] != 1 else torch.zeros_like(kv_idx)
        return t[:, :, rows, cols]  # (B, H, tq, tk)

    def block_codes(self, b):
        t = self.tensor.to(b.device)  # (B, H, Lq or 1, Lk or 1)
        pad_q = 0 if t.shape[-2] == 1 else -t.shape[-2] % b.bq
        pad_k = 0 if t.shape[-1] == 1 else -t.shape[-1] % b.bk
        bq = 1 if t.shape[-2] == 1 else b.bq
        bk = 1 if t.shape[-1] == 1 else b.bk

        # pad with True for "all" and False for "any" so the short last blocks are judged
        # on their real elements only
        def blocks(fill):
            padded = torch.nn.functional.pad(t, (0, pad_k, 0, pad_q), value=fill)
            return padded.view(*t.shape[:2], padded.shape[-2] // bq, bq, padded.shape[-1] // bk, bk)

        full = blocks(True).all(dim=-1).all(dim=-2)  # (B, H, nq or 1, nk or 1)
        empty = ~blocks(False).any(dim=-1).any(dim=-2)
        return b.code(full, empty)

    def __repr__(self):
        return f"dense(bool tensor of shape {tuple(self.tensor.shape)})"


class _FromFn(Mask):
    def __init__(self, fn, batch_size, num_heads, q_offset, kv_offset):
        if not callable(fn):
            raise AttnkitTypeError(f"from_fn takes a function fn(b, h, q_idx, kv_idx), but got {short(fn)}.")
        self.fn = fn
        self.batch_size = None if batch_size is None else check_nonnegative_int(batch_size, "batch_size")
        self.num_heads = None if num_heads is None else check_nonnegative_int(num_heads, "num_heads")
        self.q_offset = check_offset(q_offset, "q_offset")
        self.kv_offset = check_offset(kv_offset, "kv_offset")

    def tensors(self):
        return tuple(x for x in (self.q_offset, self.kv_offset) if isinstance(x, torch.Tensor))

    def lead_shape(self):
        return (self.batch_size or 1, self.num_heads or 1)

    def value_key(self):
        # the function's code and the contents of what it closes over (attnkit._cache.fingerprint):
        # a closure whose captured tensor changes has another key; None where that cannot be known
        offsets = _values(self.q_offset, self.kv_offset)
        fn = _cache.fingerprint(self.fn)
        return None if offsets is None or fn is None else ("from_fn", fn, self.batch_size, self.num_heads, offsets)

    def cacheable(self) -> bool:
        # without a value key the predicate may change behind the mask's back: never cached by identity
        return self.value_key() is not None

    def _part(self, q_start, kv_start, q_len, kv_len, q_count, kv_count):
        other = copy.copy(self)
        other.q_offset = shifted(self.q_offset, q_start)
        other.kv_offset = shifted(self.kv_offset, kv_start)
        return other

    def positions(self, q_len, kv_len, device=None):
        return _indexed_positions(self.q_offset, self.kv_offset, q_len, kv_len, device or self._device())

    def _in_cache(self, start):
        other = copy.copy(self)
        other.q_offset = self.q_offset + start  # (B,): q_idx is each query's position in its sequence
        return other

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        dev = q_idx.device
        b = torch.arange(self.batch_size or 1, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(self.num_heads or 1, device=dev).view(1, -1, 1, 1)
        qi = q_idx.reshape(1, 1, -1, 1) + per_seq(self.q_offset, dev)
        ki = kv_idx.reshape(1, 1, 1, -1) + per_seq(self.kv_offset, dev)
        out = self.fn(b, h, qi, ki)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            what = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
            raise AttnkitTypeError(
                f"a from_fn mask function must return a bool tensor (True = may attend), but got {what}."
            )
        out = as4d(out)
        shape = (b.shape[0], h.shape[0], q_idx.shape[0], kv_idx.shape[1])
        try:
            return out.expand(torch.broadcast_shapes(out.shape, (out.shape[0], out.shape[1], *shape[2:])))
        except RuntimeError:
            raise AttnkitValueError(
                f"a from_fn mask function returned shape {tuple(out.shape)}, which does not broadcast "
                f"to (B, H, tq, tk) = {shape}. Combine the index tensors b, h, q_idx, kv_idx by broadcasting."
            ) from None

    def block_codes(self, b):
        rows = []
        k_len = b.keys
        pad = -k_len % b.bk
        kv_idx = torch.arange(k_len, device=b.device)[None, :]
        for i in range(b.nq):  # one row of blocks at a time: O(bq x Lk) memory
            q_idx = torch.arange(i * b.bq, min((i + 1) * b.bq, b.q_len), device=b.device)[:, None]
            e = self.elements(q_idx, kv_idx, b.q_len, b.kv_len).view(torch.uint8)  # (B, H, tq, Lk)
            # over the rows first (one pass each over the tile), then over each block's keys
            lo, hi = e.amin(dim=-2), e.amax(dim=-2)  # (B, H, Lk)
            lo = torch.nn.functional.pad(lo, (0, pad), value=1).view(*lo.shape[:2], -1, b.bk).amin(-1)
            hi = torch.nn.functional.pad(hi, (0, pad), value=0).view(*hi.shape[:2], -1, b.bk).amax(-1)
            rows.append(b.code(lo == 1, hi == 0))  # (B, H, nk)
        if not rows:
            return torch.zeros(1, 1, 0, b.nk, dtype=torch.int8, device=b.device)
        return torch.stack(rows, dim=-2)  # (B, H, nq, nk)

    def __repr__(self):
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        return f"from_fn({name}, batch_size={self.batch_size}, num_heads={self.num_heads})"


class _Combine(Mask):
    def __init__(self, op: str, left: Mask, right: Mask):
        try:
            torch.broadcast_shapes(left.lead_shape(), right.lead_shape())
        except RuntimeError:
            raise AttnkitValueError(
                f"cannot combine masks whose (batch, head) sizes {left.lead_shape()} and "
                f"{right.lead_shape()} differ: {left!r} {op} {right!r}."
            ) from None
        lb, rb = left.batch_size, right.batch_size
        self.op, self.left, self.right = op, left, right
        self.batch_size = lb if lb is not None else rb

    def tensors(self):
        return self.left.tensors() + self.right.tensors()

    def value_key(self):
        a, b = self.left.value_key(), self.right.value_key()
        return None if a is None or b is None else (self.op, a, b)

    def cacheable(self):
        return self.left.cacheable() and self.right.cacheable()

    def key_limit(self):
        a, b = self.left.key_limit(), self.right.key_limit()
        if self.op == "&":
            if a is None or b is None:
                return a if b is None else b
            return torch.minimum(a, b)
        return None if a is None or b is None else torch.maximum(a, b)

    def lead_shape(self):
        return tuple(torch.broadcast_shapes(self.left.lead_shape(), self.right.lead_shape()))

    def check(self, q_len, kv_len):
        self.left.check(q_len, kv_len)
        self.right.check(q_len, kv_len)

    def check_values(self, q_len, kv_len):
        self.left.check_values(q_len, kv_len)
        self.right.check_values(q_len, kv_len)

    def _part(self, *where):
        return _Combine(self.op, self.left._part(*where), self.right._part(*where))

    def _in_cache(self, start):
        return _Combine(self.op, self.left._in_cache(start), self.right._in_cache(start))

    def band(self, q_len, kv_len):
        a, b = self.left.band(q_len, kv_len), self.right.band(q_len, kv_len)
        if self.op != "&" or a is None or b is None:
            return None
        lo = a[0] if b[0] is None else b[0] if a[0] is None else max(a[0], b[0])
        hi = a[1] if b[1] is None else b[1] if a[1] is None else min(a[1], b[1])
        return lo, hi

    def limit_only(self):
        return self.op == "&" and self.left.limit_only() and self.right.limit_only()

    def positions(self, q_len, kv_len, device=None):
        found = self.left.positions(q_len, kv_len, device)
        return found if found is not None else self.right.positions(q_len, kv_len, device)

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        a = as4d(self.left.elements(q_idx, kv_idx, q_len, kv_len))
        b = as4d(self.right.elements(q_idx, kv_idx, q_len, kv_len))
        return a & b if self.op == "&" else a | b

    def block_codes(self, b):
        left, right = as4d(self.left.block_codes(b)), as4d(self.right.block_codes(b))
        # EMPTY < PARTIAL < FULL: "&" keeps the lower code, "|" the higher
        return torch.minimum(left, right) if self.op == "&" else torch.maximum(left, right)

    def __repr__(self):
        def part(m):
            return f"({m!r})" if isinstance(m, _Combine) and m.op != self.op else repr(m)

        return f"{part(self.left)} {self.op} {part(self.right)}"


class _Cached(Mask):
    def __init__(self, mask, start, lengths):
        self.start = own(check_int_tensor(start, "start", (1,)))
        self.lengths = own(check_int_tensor(lengths, "lengths", (1,)))
        if self.start.shape != self.lengths.shape:
            raise AttnkitValueError(
                f"start and lengths must have one entry per sequence, but got shapes "
                f"{tuple(self.start.shape)} and {tuple(self.lengths.shape)}."
            )
        self.mask = None if mask is None else as_mask(mask)._in_cache(self.start)
        self.batch_size = self.start.shape[0]

    def tensors(self):
        return (self.start, self.lengths) + (self.mask.tensors() if self.mask else ())

    def value_key(self):
        values = _values(self.start, self.lengths)
        inner = None if self.mask is None else self.mask.value_key()
        if values is None or (self.mask is not None and inner is None):
            return None
        return ("cached", values, inner)

    def cacheable(self):
        return self.mask is None or self.mask.cacheable()

    def key_limit(self):
        return self.lengths

    def lead_shape(self):
        own = (self.batch_size, 1)
        return own if self.mask is None else tuple(torch.broadcast_shapes(own, self.mask.lead_shape()))

    def check_values(self, q_len, kv_len):
        longest = int(self.lengths.max()) if self.lengths.numel() else 0
        if longest > kv_len:
            raise AttnkitValueError(f"cached mask has a sequence of length {longest} but only Lk={kv_len} keys.")

    def limit_only(self):
        return self.mask is None

    def positions(self, q_len, kv_len, device=None):
        device = device or self.start.device
        q = self.start.to(device)[:, None] + torch.arange(q_len, device=device)  # (B, Lq): after each fill
        return q, torch.arange(kv_len, device=device)[None, :]

    def _ends(self, q_len, device):
        """Where each sequence's queries end, ``(B, 1, 1, 1)``."""
        return (self.start.to(device) + q_len).view(-1, 1, 1, 1)

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        device = kv_idx.device
        valid = as4d(kv_idx < self.lengths.to(device).view(-1, 1, 1, 1))  # (B, 1, 1, tk)
        if self.mask is None:
            return valid
        return as4d(self.mask.elements(q_idx, kv_idx, q_len, self._ends(q_len, device))) & valid

    def block_codes(self, b):
        lengths = self.lengths.to(b.device).view(-1, 1, 1, 1)
        valid = b.code(full=b.k_hi < lengths, empty=b.k_lo >= lengths)  # (B, 1, 1, nk)
        if self.mask is None:
            return valid
        inner = as4d(self.mask.block_codes(b.with_kv_len(self._ends(b.q_len, b.device))))
        return torch.minimum(inner, valid)

    def __repr__(self):
        return f"cached({self.mask!r}, start={short(self.start.tolist())}, lengths={short(self.lengths.tolist())})"


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
    return _Cached(mask, start, lengths)


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
    return _Causal(align, q_offset, kv_offset)


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
    return _SlidingWindow(left, right, align, q_offset, kv_offset)


def prefix_lm(prefix_len: IntLike, align: str = "bottom_right", *, q_offset: Offset = 0, kv_offset: Offset = 0) -> Mask:
    """Query i may attend key j iff ``j' < prefix_len`` or ``j' <= p(i)``, with ``j' = j + kv_offset``.

    ``prefix_len`` is an int or a tensor of shape ``(B,)`` (one prefix per sequence).

    >>> print(prefix_lm(2).picture(4, 4))
    1 1 0 0
    1 1 0 0
    1 1 1 0
    1 1 1 1
    """
    return _PrefixLM(prefix_len, align, q_offset, kv_offset)


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
    return _Document(ids, q_offset, kv_offset)


def padding(lengths: torch.Tensor | Sequence[int], *, kv_offset: Offset = 0) -> Mask:
    """Query i of sequence b may attend key j iff ``j + kv_offset < lengths[b]``.

    ``lengths`` has shape ``(B,)``; keys past a sequence's length are padding. Kernels
    never read them, so anything stored there (NaN included) cannot reach the output.

    >>> print(padding([2, 3]).picture(2, 4, batch=0))
    1 1 0 0
    1 1 0 0
    """
    return _Padding(lengths, kv_offset)


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
    return _Dense(tensor)


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
    return _FromFn(fn, batch_size, num_heads, q_offset, kv_offset)


def as_mask(mask: Mask | torch.Tensor) -> Mask:
    """Return ``mask`` as a :class:`Mask`: mask objects as they are, bool tensors wrapped."""
    if isinstance(mask, Mask):
        return mask
    if isinstance(mask, torch.Tensor):
        return _Dense(mask)
    raise AttnkitTypeError(f"expected an attnkit mask or a bool tensor, but got {type(mask).__name__}.")
