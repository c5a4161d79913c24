"""The mask algebra: which keys each query may attend to.

One convention everywhere in attnkit: **True means "may attend"**, as in
``torch.nn.functional.scaled_dot_product_attention``.

A mask object describes a pattern without storing an ``Lq x Lk`` matrix. Combine
them with ``&`` (both allow) and ``|`` (either allows), hand them to
:func:`attnkit.attention`, or turn them into a dense bool tensor with
:meth:`Mask.materialize`. Query positions are bottom-right aligned by default:
query ``i`` sits at position ``p(i) = i + (Lk - Lq)``, so a single decoding query
sees every cached key; ``align="top_left"`` gives ``p(i) = i``.

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

import torch

from attnkit._validate import (
    AttnkitTypeError,
    AttnkitValueError,
    check_int_tensor,
    check_nonnegative_int,
)

__all__ = [
    "Mask",
    "causal",
    "sliding_window",
    "prefix_lm",
    "document",
    "padding",
    "dense",
    "cached",
    "as_mask",
]

_ALIGNS = ("bottom_right", "top_left")


def _as4d(t: torch.Tensor) -> torch.Tensor:
    """Left-pad a (tq, tk) or (B, tq, tk) element mask to (B, H, tq, tk)."""
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t[:, None]
    return t


def _check_align(align: str) -> str:
    if align not in _ALIGNS:
        raise AttnkitValueError(f"align must be 'bottom_right' or 'top_left', but got {align!r}.")
    return align


def _positions(q_idx: torch.Tensor, q_len: int, kv_len, align: str) -> torch.Tensor:
    """Key-axis position p(i) of each query index (bottom-right: i + Lk - Lq).

    ``kv_len`` is an int, or a ``(B, 1, 1)`` tensor when each sequence ends elsewhere
    (see :func:`cached`).
    """
    return q_idx + (kv_len - q_len) if align == "bottom_right" else q_idx


#: Block-map codes: no pair of the block may attend / some may / all may.
EMPTY, PARTIAL, FULL = 0, 1, 2


class _Blocks:
    """Index ranges of every (query block, key block) pair, shape (nq, 1) and (1, nk).

    ``q_lo/q_hi`` are the first and last query index of each query block, ``k_lo/k_hi``
    the first and last key index of each key block (the last blocks may be short).
    """

    def __init__(self, q_len: int, kv_len: int, bq: int, bk: int, device=None):
        self.q_len, self.kv_len, self.bq, self.bk = q_len, kv_len, bq, bk
        nq, nk = -(-q_len // bq), -(-kv_len // bk)
        q0 = torch.arange(nq, device=device) * bq
        k0 = torch.arange(nk, device=device) * bk
        self.q_lo, self.q_hi = q0[:, None], (q0 + bq).clamp(max=q_len)[:, None] - 1
        self.k_lo, self.k_hi = k0[None, :], (k0 + bk).clamp(max=kv_len)[None, :] - 1

    def code(self, full: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
        """int8 codes (..., nq, nk) from bool "every pair allowed" / "no pair allowed"."""
        full, empty = torch.broadcast_tensors(full, empty)
        out = torch.full(full.shape, PARTIAL, dtype=torch.int8, device=full.device)
        return out.masked_fill_(full, FULL).masked_fill_(empty, EMPTY)


def _block_minmax(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block min and max over the last dim of ``x: (B, L)`` -> (B, ceil(L / block))."""
    length = x.shape[-1]
    pad = -length % block
    lo = torch.nn.functional.pad(x, (0, pad), value=int(x.max()) if length else 0)
    hi = torch.nn.functional.pad(x, (0, pad), value=int(x.min()) if length else 0)
    lo = lo.view(*x.shape[:-1], -1, block).amin(-1)
    hi = hi.view(*x.shape[:-1], -1, block).amax(-1)
    return lo, hi


class Mask:
    """A pattern of allowed (query, key) pairs; True means "may attend".

    Subclasses define :meth:`_elements`, which evaluates the pattern on any set of
    query and key indices, so kernels can evaluate one tile at a time and
    :meth:`materialize` is just the tile that covers everything.
    """

    #: Number of sequences the mask is specific to (None: the same for every sequence).
    batch_size: int | None = None

    def _elements(
        self, q_idx: torch.Tensor, kv_idx: torch.Tensor, q_len: int, kv_len: int
    ) -> torch.Tensor:
        """Allowed pairs for ``q_idx: (tq, 1)`` and ``kv_idx: (1, tk)``.

        Returns a bool tensor of shape ``(B or 1, H or 1, tq, tk)``.
        """
        raise NotImplementedError

    def _device(self) -> torch.device | None:
        """The device of the tensors the mask holds (None if it holds none)."""
        return None

    def _held(self) -> tuple[torch.Tensor, ...]:
        """The tensors the mask was built from."""
        return ()

    def _versions(self) -> tuple:
        """Identity and in-place version of each held tensor (a cache key)."""
        return tuple((t.data_ptr(), t._version) for t in self._held())

    def lead_shape(self) -> tuple[int, int]:
        """``(B or 1, H or 1)``: the batch and head sizes of :meth:`materialize`'s result."""
        return (self.batch_size or 1, 1)

    def check(self, q_len: int, kv_len: int) -> None:
        """Raise ``ValueError`` if this mask was built for other lengths than these."""

    def materialize(self, q_len: int, kv_len: int, device=None) -> torch.Tensor:
        """The dense bool mask, shape ``(B or 1, H or 1, Lq, Lk)``; True = may attend.

        Equivalent pytorch code for ``causal()``:
        ``torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq)[None, None]``.
        """
        q_len = check_nonnegative_int(q_len, "q_len")
        kv_len = check_nonnegative_int(kv_len, "kv_len")
        self.check(q_len, kv_len)
        if device is None:
            device = self._device()
        q_idx = torch.arange(q_len, device=device)[:, None]
        kv_idx = torch.arange(kv_len, device=device)[None, :]
        out = self._elements(q_idx, kv_idx, q_len, kv_len)
        return out.expand(*out.shape[:2], q_len, kv_len)

    def block_map(self, q_len: int, kv_len: int, bq: int, bk: int, device=None) -> torch.Tensor:
        """Classify every ``bq x bk`` block: ``(B or 1, H or 1, ceil(Lq/bq), ceil(Lk/bk))`` int8.

        Codes: ``EMPTY`` (0, no pair may attend), ``PARTIAL`` (1) and ``FULL`` (2, every
        pair may attend). Computed from the blocks' index ranges, never from an
        ``Lq x Lk`` tensor (dense masks are reduced block by block). EMPTY and FULL
        are always exact; PARTIAL may be reported for a block that is in fact empty or
        full where that cannot be known cheaply (combinations, unsorted document ids).

        >>> causal().block_map(4, 4, 2, 2)[0, 0].tolist()
        [[1, 0], [2, 1]]
        """
        q_len = check_nonnegative_int(q_len, "q_len")
        kv_len = check_nonnegative_int(kv_len, "kv_len")
        self.check(q_len, kv_len)
        if device is None:
            device = self._device()
        blocks = _Blocks(q_len, kv_len, bq, bk, device)
        codes = self._block_codes(blocks)
        while codes.dim() < 4:
            codes = codes[None]
        return codes.expand(*codes.shape[:2], blocks.q_lo.shape[0], blocks.k_lo.shape[1])

    def _block_codes(self, blocks: _Blocks) -> torch.Tensor:
        """Codes ``(..., nq, nk)`` for the block ranges; see :meth:`block_map`."""
        raise NotImplementedError

    def picture(self, q_len: int, kv_len: int, *, batch: int = 0, head: int = 0) -> str:
        """The mask as rows of ``1`` (may attend) and ``0`` (hidden), one row per query."""
        m = self.materialize(q_len, kv_len)
        m = m[min(batch, m.shape[0] - 1), min(head, m.shape[1] - 1)]
        return "\n".join(" ".join("1" if x else "0" for x in row) for row in m.tolist())

    def __and__(self, other) -> Mask:
        return _Combine("&", self, as_mask(other))

    def __rand__(self, other) -> Mask:
        return _Combine("&", as_mask(other), self)

    def __or__(self, other) -> Mask:
        return _Combine("|", self, as_mask(other))

    def __ror__(self, other) -> Mask:
        return _Combine("|", as_mask(other), self)


class _Causal(Mask):
    def __init__(self, align: str):
        self.align = _check_align(align)

    def _elements(self, q_idx, kv_idx, q_len, kv_len):
        return _as4d(kv_idx <= _positions(q_idx, q_len, kv_len, self.align))

    def _block_codes(self, b):
        p_lo = _positions(b.q_lo, b.q_len, b.kv_len, self.align)
        p_hi = _positions(b.q_hi, b.q_len, b.kv_len, self.align)
        return b.code(full=b.k_hi <= p_lo, empty=b.k_lo > p_hi)

    def __repr__(self):
        return f"causal(align={self.align!r})"


class _SlidingWindow(Mask):
    def __init__(self, left: int, right: int, align: str):
        self.left = check_nonnegative_int(left, "left")
        self.right = check_nonnegative_int(right, "right")
        self.align = _check_align(align)

    def _elements(self, q_idx, kv_idx, q_len, kv_len):
        p = _positions(q_idx, q_len, kv_len, self.align)
        return _as4d((kv_idx >= p - self.left) & (kv_idx <= p + self.right))

    def _block_codes(self, b):
        p_lo = _positions(b.q_lo, b.q_len, b.kv_len, self.align)
        p_hi = _positions(b.q_hi, b.q_len, b.kv_len, self.align)
        full = (b.k_lo >= p_hi - self.left) & (b.k_hi <= p_lo + self.right)
        empty = (b.k_hi < p_lo - self.left) | (b.k_lo > p_hi + self.right)
        return b.code(full, empty)

    def __repr__(self):
        return f"sliding_window(left={self.left}, right={self.right}, align={self.align!r})"


class _PrefixLM(Mask):
    def __init__(self, prefix_len, align: str):
        if isinstance(prefix_len, torch.Tensor):
            prefix_len = check_int_tensor(prefix_len, "prefix_len", (1,))
            if (prefix_len < 0).any():
                raise AttnkitValueError(
                    f"prefix_len must be >= 0, but got {prefix_len.tolist()}."
                )
            self.batch_size = prefix_len.shape[0]
        else:
            prefix_len = check_nonnegative_int(prefix_len, "prefix_len")
        self.prefix_len = prefix_len
        self.align = _check_align(align)

    def _device(self):
        return self.prefix_len.device if isinstance(self.prefix_len, torch.Tensor) else None

    def _held(self):
        return (self.prefix_len,) if isinstance(self.prefix_len, torch.Tensor) else ()

    def _elements(self, q_idx, kv_idx, q_len, kv_len):
        prefix = self.prefix_len
        if isinstance(prefix, torch.Tensor):
            prefix = prefix.to(kv_idx.device)[:, None, None]  # (B, 1, 1)
        causal = kv_idx <= _positions(q_idx, q_len, kv_len, self.align)
        return _as4d((kv_idx < prefix) | causal)

    def _block_codes(self, b):
        prefix = self.prefix_len
        if isinstance(prefix, torch.Tensor):
            prefix = prefix.to(b.k_lo.device)[:, None, None, None]  # (B, 1, 1, 1)
        p_lo = _positions(b.q_lo, b.q_len, b.kv_len, self.align)
        p_hi = _positions(b.q_hi, b.q_len, b.kv_len, self.align)
        full = (b.k_hi < prefix) | (b.k_hi <= p_lo)
        empty = (b.k_lo >= prefix) & (b.k_lo > p_hi)
        return b.code(full, empty)

    def __repr__(self):
        p = self.prefix_len
        p = p.tolist() if isinstance(p, torch.Tensor) else p
        return f"prefix_lm(prefix_len={p}, align={self.align!r})"


class _Document(Mask):
    def __init__(self, ids):
        ids = check_int_tensor(ids, "ids", (1, 2))
        self.ids = ids if ids.dim() == 2 else ids[None]  # (B or 1, L)
        self.batch_size = ids.shape[0] if ids.dim() == 2 else None

    def _device(self):
        return self.ids.device

    def _held(self):
        return (self.ids,)

    def check(self, q_len, kv_len):
        length = self.ids.shape[-1]
        if q_len != length or kv_len != length:
            raise AttnkitValueError(
                f"document mask was built for sequences of length L={length} but is used with "
                f"Lq={q_len}, Lk={kv_len}. A document mask is for self-attention over the "
                "packed sequence: pass ids with one entry per token."
            )

    def _elements(self, q_idx, kv_idx, q_len, kv_len):
        ids = self.ids.to(q_idx.device)
        same = ids[:, q_idx[:, 0]][:, :, None] == ids[:, kv_idx[0]][:, None, :]  # (B, tq, tk)
        return _as4d(same)

    def _block_codes(self, b):
        ids = self.ids.to(b.k_lo.device)
        q_min, q_max = _block_minmax(ids, b.bq)  # (B, nq)
        k_min, k_max = _block_minmax(ids, b.bk)  # (B, nk)
        q_min, q_max = q_min[:, None, :, None], q_max[:, None, :, None]  # (B, 1, nq, 1)
        k_min, k_max = k_min[:, None, None, :], k_max[:, None, None, :]  # (B, 1, 1, nk)
        full = (q_min == q_max) & (k_min == k_max) & (q_min == k_min)
        empty = (q_max < k_min) | (k_max < q_min)  # id ranges that cannot meet
        return b.code(full, empty)

    def __repr__(self):
        ids = self.ids if self.batch_size else self.ids[0]
        return f"document(ids of shape {tuple(ids.shape)})"


class _Padding(Mask):
    def __init__(self, lengths):
        lengths = check_int_tensor(lengths, "lengths", (1,))
        if (lengths < 0).any():
            raise AttnkitValueError(f"lengths must be >= 0, but got {lengths.tolist()}.")
        self.lengths = lengths
        self.batch_size = lengths.shape[0]

    def _device(self):
        return self.lengths.device

    def _held(self):
        return (self.lengths,)

    def check(self, q_len, kv_len):
        longest = int(self.lengths.max()) if self.lengths.numel() else 0
        if longest > kv_len:
            raise AttnkitValueError(
                f"padding mask has a sequence of length {longest} but the keys have only "
                f"Lk={kv_len} positions. lengths must be <= Lk."
            )

    def _elements(self, q_idx, kv_idx, q_len, kv_len):
        lengths = self.lengths.to(kv_idx.device)[:, None, None]  # (B, 1, 1)
        return _as4d(kv_idx < lengths)  # (B, 1, 1, tk)

    def _block_codes(self, b):
        lengths = self.lengths.to(b.k_lo.device)[:, None, None, None]  # (B, 1, 1, 1)
        return b.code(full=b.k_hi < lengths, empty=b.k_lo >= lengths)

    def __repr__(self):
        return f"padding(lengths={self.lengths.tolist()})"


class _Dense(Mask):
    def __init__(self, tensor: torch.Tensor):
        if not isinstance(tensor, torch.Tensor):
            raise AttnkitTypeError(f"a dense mask must be a torch.Tensor, but got {type(tensor).__name__}.")
        if tensor.dtype != torch.bool:
            raise AttnkitTypeError(
                f"a dense mask must be bool (True = may attend), but got {tensor.dtype}. "
                "Use mask != 0 to convert a 0/1 mask."
            )
        if not 2 <= tensor.dim() <= 4:
            raise AttnkitValueError(
                "a dense mask must have shape (Lq, Lk), (B, Lq, Lk) or (B, H, Lq, Lk), "
                f"but got {tuple(tensor.shape)}."
            )
        self.tensor = _as4d(tensor)
        self.batch_size = self.tensor.shape[0] if self.tensor.shape[0] != 1 else None

    def _device(self):
        return self.tensor.device

    def _held(self):
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

    def _elements(self, q_idx, kv_idx, q_len, kv_len):
        t = self.tensor.to(q_idx.device)
        rows = q_idx if t.shape[-2] != 1 else torch.zeros_like(q_idx)
        cols = kv_idx if t.shape[-1] != 1 else torch.zeros_like(kv_idx)
        return t[:, :, rows, cols]  # (B, H, tq, tk)

    def _block_codes(self, b):
        t = self.tensor.to(b.k_lo.device)  # (B, H, Lq or 1, Lk or 1)
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

    def _device(self):
        return self.left._device() or self.right._device()

    def _held(self):
        return self.left._held() + self.right._held()

    def lead_shape(self):
        return tuple(torch.broadcast_shapes(self.left.lead_shape(), self.right.lead_shape()))

    def check(self, q_len, kv_len):
        self.left.check(q_len, kv_len)
        self.right.check(q_len, kv_len)

    def _elements(self, q_idx, kv_idx, q_len, kv_len):
        a = self.left._elements(q_idx, kv_idx, q_len, kv_len)
        b = self.right._elements(q_idx, kv_idx, q_len, kv_len)
        return a & b if self.op == "&" else a | b

    def _block_codes(self, b):
        left, right = self.left._block_codes(b), self.right._block_codes(b)
        # EMPTY < PARTIAL < FULL: "&" keeps the lower code, "|" the higher
        return torch.minimum(left, right) if self.op == "&" else torch.maximum(left, right)

    def __repr__(self):
        def part(m):
            return f"({m!r})" if isinstance(m, _Combine) and m.op != self.op else repr(m)

        return f"{part(self.left)} {self.op} {part(self.right)}"


class _Cached(Mask):
    def __init__(self, mask, start, lengths):
        self.mask = None if mask is None else as_mask(mask)
        self.start = check_int_tensor(start, "start", (1,))
        self.lengths = check_int_tensor(lengths, "lengths", (1,))
        if self.start.shape != self.lengths.shape:
            raise AttnkitValueError(
                f"start and lengths must have one entry per sequence, but got shapes "
                f"{tuple(self.start.shape)} and {tuple(self.lengths.shape)}."
            )
        self.batch_size = self.start.shape[0]

    def _device(self):
        return self.lengths.device

    def _held(self):
        return (self.start, self.lengths) + (self.mask._held() if self.mask else ())

    def lead_shape(self):
        own = (self.batch_size, 1)
        return own if self.mask is None else tuple(torch.broadcast_shapes(own, self.mask.lead_shape()))

    def check(self, q_len, kv_len):
        longest = int(self.lengths.max()) if self.lengths.numel() else 0
        if longest > kv_len:
            raise AttnkitValueError(f"cached mask has a sequence of length {longest} but only Lk={kv_len} keys.")

    def _elements(self, q_idx, kv_idx, q_len, kv_len):
        device = kv_idx.device
        valid = _as4d(kv_idx < self.lengths.to(device)[:, None, None])  # (B, 1, 1, tk)
        if self.mask is None:
            return valid
        ends = (self.start.to(device) + q_len)[:, None, None]  # where each sequence's queries end
        return self.mask._elements(q_idx, kv_idx, q_len, ends) & valid

    def _block_codes(self, b):
        lengths = self.lengths.to(b.k_lo.device)[:, None, None, None]  # (B, 1, 1, 1)
        empty = b.k_lo >= lengths
        return b.code(full=torch.zeros_like(empty), empty=empty)  # PARTIAL where not empty

    def __repr__(self):
        return f"cached({self.mask!r}, start={self.start.tolist()}, lengths={self.lengths.tolist()})"


def cached(mask, start, lengths) -> Mask:
    """``mask`` for sequences stored left-aligned in a KV cache of varying fill.

    Query i of sequence b sits at key position ``start[b] + i`` (so a bottom-right
    aligned mask is aligned with each sequence's own end) and keys ``j >= lengths[b]``
    are empty slots. :class:`attnkit.nn.KVCache` builds this for you.

    >>> print(cached(causal(), start=torch.tensor([1, 3]), lengths=torch.tensor([3, 5])).picture(2, 5, batch=0))
    1 1 0 0 0
    1 1 1 0 0
    """
    return _Cached(mask, start, lengths)


def causal(align: str = "bottom_right") -> Mask:
    """Query i may attend key j iff ``j <= p(i)``.

    ``p(i) = i + (Lk - Lq)`` (``align="bottom_right"``, the default) or ``p(i) = i``
    (``align="top_left"``). With Lq == Lk both are the lower triangle:

    >>> print(causal().picture(3, 5))
    1 1 1 0 0
    1 1 1 1 0
    1 1 1 1 1
    >>> print(causal(align="top_left").picture(3, 5))
    1 0 0 0 0
    1 1 0 0 0
    1 1 1 0 0
    """
    return _Causal(align)


def sliding_window(left: int, right: int = 0, align: str = "bottom_right") -> Mask:
    """Query i may attend key j iff ``p(i) - left <= j <= p(i) + right``.

    >>> print(sliding_window(1, 1).picture(4, 4))
    1 1 0 0
    1 1 1 0
    0 1 1 1
    0 0 1 1
    """
    return _SlidingWindow(left, right, align)


def prefix_lm(prefix_len, align: str = "bottom_right") -> Mask:
    """Query i may attend key j iff ``j < prefix_len`` or ``j <= p(i)``.

    ``prefix_len`` is an int or a tensor of shape ``(B,)`` (one prefix per sequence).

    >>> print(prefix_lm(2).picture(4, 4))
    1 1 0 0
    1 1 0 0
    1 1 1 0
    1 1 1 1
    """
    return _PrefixLM(prefix_len, align)


def document(ids) -> Mask:
    """Query i may attend key j iff ``ids[i] == ids[j]`` (packed sequences).

    ``ids`` has shape ``(L,)`` or ``(B, L)``; it is for self-attention over the
    packed sequence, so Lq == Lk == L. Combine with :func:`causal` for packed
    causal language modelling.

    >>> print(document([0, 0, 1, 1, 1]).picture(5, 5))
    1 1 0 0 0
    1 1 0 0 0
    0 0 1 1 1
    0 0 1 1 1
    0 0 1 1 1
    """
    return _Document(ids)


def padding(lengths) -> Mask:
    """Query i of sequence b may attend key j iff ``j < lengths[b]``.

    ``lengths`` has shape ``(B,)``; keys past a sequence's length are padding.

    >>> print(padding([2, 3]).picture(2, 4, batch=0))
    1 1 0 0
    1 1 0 0
    """
    return _Padding(lengths)


def dense(tensor: torch.Tensor) -> Mask:
    """Wrap a bool tensor ``(Lq, Lk)``, ``(B, Lq, Lk)`` or ``(B, H, Lq, Lk)`` (1s broadcast).

    >>> import torch
    >>> m = dense(torch.tensor([[True, False], [True, True]])) & causal()
    >>> print(m.picture(2, 2))
    1 0
    1 1
    """
    return _Dense(tensor)


def as_mask(mask) -> Mask:
    """Return ``mask`` as a :class:`Mask`: mask objects as they are, bool tensors wrapped."""
    if isinstance(mask, Mask):
        return mask
    if isinstance(mask, torch.Tensor):
        return _Dense(mask)
    raise AttnkitTypeError(
        f"expected an attnkit mask or a bool tensor, but got {type(mask).__name__}."
    )
