"""The mask protocol every kind of mask implements (:class:`Mask`), block classification
(:class:`Blocks`), the ``&``/``|`` algebra (:class:`Combine`), dense masks and the helpers the
kinds share. The constructors users call are in :mod:`attnkit.masks`."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from attnkit._indexing import as4d, own, span
from attnkit._types import Device, IntLike
from attnkit._validate import (
    AttnkitTypeError,
    AttnkitValueError,
    check_nonnegative_int,
    short,
)
from attnkit.masks import _lists
from attnkit.masks._codes import EMPTY, FULL, PARTIAL

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "Blocks",
    "Combine",
    "Dense",
    "Mask",
    "as_mask",
    "batch_of",
    "block_minmax",
    "value_of",
    "values_of",
]


#: Tensors of at most this many elements (on the CPU) are part of a mask's value key.
KEY_ELEMENTS = 1 << 16


def value_of(x):
    """A hashable stand-in for an int or a small CPU tensor (None: too large to key by value)."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.device.type != "cpu" or x.numel() > KEY_ELEMENTS:
        return None
    if x.dim() == 1 and x.numel() <= 64:  # a decoding step's lengths: tolist is 3x faster than a byte copy
        return (x.shape, x.dtype, tuple(x.tolist()))
    return (tuple(x.shape), x.dtype, x.contiguous().numpy().tobytes())


def values_of(*xs):
    """``tuple(value_of(x) for x in xs)``, or None if one cannot be keyed."""
    out = []
    for x in xs:
        value = value_of(x)
        if value is None and x is not None:
            return None
        out.append(value)
    return tuple(out)


def batch_of(*values) -> int | None:
    """The batch size implied by per-sequence tensors among ``values`` (None if none)."""
    sizes = {v.shape[0] for v in values if isinstance(v, torch.Tensor) and v.shape[0] != 1}
    if len(sizes) > 1:
        raise AttnkitValueError(f"per-sequence arguments have different batch sizes {sorted(sizes)}.")
    return sizes.pop() if sizes else None


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


def block_minmax(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
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

    def tiles(self, b, h, q_idx, kv_idx, q_len: int, kv_len: int) -> torch.Tensor | None:
        """Allowed pairs of T tiles at once, each of its own sequence and head: broadcasting 3-d
        index tensors ``b``, ``h`` ``(T, 1, 1)`` and ``q_idx``, ``kv_idx`` (e.g. ``(T, 1, tq)`` and
        ``(T, tk, 1)``: key-major tiles) give a bool of their broadcast shape, or None where the
        kind has no such form (:meth:`elements` is used)."""
        return None

    def packed_tiles(self, where: torch.Tensor, q_len: int, kv_len: int, block_size) -> torch.Tensor | None:
        """The partial tiles ``where`` ``(T, 4)`` (b, h, row block, key block) as a prepared mask keeps
        them, key-major and packed eight queries a byte ``(T, bk, ceil(bq / 8))`` uint8, pairs past the
        lengths False; None where the kind does not make them itself (:meth:`tiles` is used)."""
        return None

    def codes_with_tiles(
        self, q_len: int, kv_len: int, bq: int, bk: int, device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The block codes ``(B or 1, H or 1, nq, nk)`` int8 with the partial blocks ``where (T, 4)`` and
        their bits as :meth:`packed_tiles` gives them, made together where evaluating the pairs once
        gives both; None where the kind does not (:meth:`block_codes`, then the bits of its partial
        blocks, are used)."""
        return None

    def query_ranges(self, b, h, kv_idx, q_len: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For each key of T tiles, the queries that may see it as one range: ``(lo, hi)``, query
        indices (inclusive; ``lo > hi``: none) broadcasting to ``kv_idx``'s shape ``(T, tk)``, with
        ``b``, ``h`` ``(T, 1)`` each tile's sequence and head. None where the kind's allowed
        queries are not one range per key (:meth:`tiles` is used). Values may lie outside
        ``[0, q_len)``: only the part inside counts. Within ``±RANGE_END`` (2**30)."""
        return None

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

        >>> from attnkit.masks import causal, sliding_window
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

        >>> from attnkit.masks import causal, sliding_window
        >>> causal().positions(2, 4)
        (tensor([[2, 3]]), tensor([[0, 1, 2, 3]]))
        """
        return None

    def _in_cache(self, start: torch.Tensor) -> Mask:
        """This mask for queries that sit at key positions ``start[b] + i`` (a KV cache).

        Positional masks align through the per-sequence key length :class:`Cached` gives
        them; masks whose indices *are* positions (``from_fn``, documents) move their
        query offsets by ``start`` here. Dense masks are for the call's shape as given.
        """
        return self

    def key_limit(self) -> torch.Tensor | None:
        """``(B or 1,)`` tensor: keys from ``limit[b]`` on are hidden for every query of b.

        None when the mask has no such limit. Kernels never read keys past it.
        """
        return None

    def key_limit_values(self) -> tuple[int, ...] | None:
        """:meth:`key_limit` as Python ints (one host read of B values), or None."""
        limit = self.key_limit()
        return None if limit is None else tuple(limit.tolist())

    def limit_free_key(self) -> Hashable | None:
        """A key of this mask's value with its key limits left out (their count kept), for a mask
        that hides exactly the keys past each sequence's limit and holds them as ints: two such
        masks with one key differ only in their limits. None for every other mask."""
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

        >>> from attnkit.masks import causal, sliding_window
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

    def to_block_mask(self, q_len: int, kv_len: int, BLOCK_SIZE: int | tuple[int, int] = 128, device: Device = None):  # noqa: N803
        """This mask as FlexAttention's ``BlockMask``: its block map at ``BLOCK_SIZE`` and a
        ``mask_mod`` that evaluates it, so torch's ``flex_attention`` runs it too
        (:func:`attnkit.masks.blockmask.to_block_mask`; ``masks.from_block_mask`` reads one back)."""
        return _lists.to_block_mask(self, q_len, kv_len, BLOCK_SIZE, device)

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

        >>> from attnkit.masks import causal, sliding_window
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
        return Combine("&", self, as_mask(other))

    def __rand__(self, other) -> Mask:
        return Combine("&", as_mask(other), self)

    def __or__(self, other) -> Mask:
        return Combine("|", self, as_mask(other))

    def __ror__(self, other) -> Mask:
        return Combine("|", as_mask(other), self)


class Dense(Mask):
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
        return Dense(t)

    def elements(self, q_idx, kv_idx, q_len, kv_len):
        t = self.tensor.to(q_idx.device)
        rows = q_idx if t.shape[-2] != 1 else torch.zeros_like(q_idx)
        cols = kv_idx if t.shape[-1] != 1 else torch.zeros_like(kv_idx)
        return t[:, :, rows, cols]  # (B, H, tq, tk)

    def tiles(self, b, h, q_idx, kv_idx, q_len, kv_len):
        t = self.tensor.to(q_idx.device)
        at = [x.clamp(max=n - 1) for x, n in zip((b, h, q_idx, kv_idx), t.shape)]  # size-1 axes broadcast
        return t[at[0], at[1], at[2], at[3]]

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


class Combine(Mask):
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
        return Combine(self.op, self.left._part(*where), self.right._part(*where))

    def _in_cache(self, start):
        return Combine(self.op, self.left._in_cache(start), self.right._in_cache(start))

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

    def tiles(self, b, h, q_idx, kv_idx, q_len, kv_len):
        left = self.left.tiles(b, h, q_idx, kv_idx, q_len, kv_len)
        right = None if left is None else self.right.tiles(b, h, q_idx, kv_idx, q_len, kv_len)
        if left is None or right is None:
            return None
        return left & right if self.op == "&" else left | right

    def query_ranges(self, b, h, kv_idx, q_len, kv_len):
        if self.op != "&":
            return None  # two ranges' union is not one range
        left = self.left.query_ranges(b, h, kv_idx, q_len, kv_len)
        right = None if left is None else self.right.query_ranges(b, h, kv_idx, q_len, kv_len)
        if left is None or right is None:
            return None
        return torch.maximum(left[0], right[0]), torch.minimum(left[1], right[1])

    def block_codes(self, b):
        left, right = as4d(self.left.block_codes(b)), as4d(self.right.block_codes(b))
        # EMPTY < PARTIAL < FULL: "&" keeps the lower code, "|" the higher
        return torch.minimum(left, right) if self.op == "&" else torch.maximum(left, right)

    def __repr__(self):
        def part(m):
            return f"({m!r})" if isinstance(m, Combine) and m.op != self.op else repr(m)

        return f"{part(self.left)} {self.op} {part(self.right)}"


def as_mask(mask: Mask | torch.Tensor) -> Mask:
    """Return ``mask`` as a :class:`Mask`: mask objects as they are, bool tensors wrapped."""
    if isinstance(mask, Mask):
        return mask
    if isinstance(mask, torch.Tensor):
        return Dense(mask)
    raise AttnkitTypeError(f"expected an attnkit mask or a bool tensor, but got {type(mask).__name__}.")
