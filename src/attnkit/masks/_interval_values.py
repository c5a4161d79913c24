"""The values of :mod:`attnkit.masks._intervals`: an :class:`Interval` bounds what a predicate
computes on a block of pairs, and a captured tensor indexed by ranges (:class:`_Table`: min and
max of the entries each block may read, through sparse tables). The rules of each operation are in
``_intervals.py``; :data:`RULES` is where they are registered."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from numbers import Number

import torch

__all__ = [
    "BLOCK_DIMS",
    "RULES",
    "Interval",
    "Tables",
    "Unsupported",
    "getitem",
    "lift",
    "lifted",
    "pair_dims",
    "tables",
    "top_of",
]

#: name of a torch function or Tensor method -> its interval rule (filled by ``_intervals.py``)
RULES: dict[str, Callable] = {}


class Unsupported(Exception):
    """An operation interval arithmetic does not bound; the caller takes the pair-by-pair path."""


def top_of(dtype: torch.dtype, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The widest range of ``dtype``, shaped like ``like``."""
    lo: float | int | bool
    hi: float | int | bool
    if dtype == torch.bool:
        lo, hi = False, True
    elif dtype.is_floating_point:
        lo, hi = -math.inf, math.inf
    else:
        info = torch.iinfo(dtype)
        lo, hi = info.min, info.max
    return torch.full_like(like, lo, dtype=dtype), torch.full_like(like, hi, dtype=dtype)


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    if name.startswith("__") and name.endswith("__") and name not in _DUNDER_KEPT:
        name = name[2:-2]
    return name


# dunders whose reflected or in-place form means something else: kept with their underscores
_DUNDER_KEPT = frozenset({"__getitem__"})


class Interval:
    """Per-block bounds ``lo <= value <= hi`` of a tensor the predicate computes (bool: ``lo`` True
    means True on every pair of the block, ``hi`` False means False on every pair)."""

    __hash__ = object.__hash__

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor, bits: tuple[torch.Tensor, torch.Tensor] | None = None):
        if lo.dtype.is_floating_point:  # a NaN endpoint bounds nothing: that block's range is everything
            bad = lo.isnan() | hi.isnan()
            lo, hi = lo.masked_fill(bad, -math.inf), hi.masked_fill(bad, math.inf)
        self.lo, self.hi = lo, hi
        #: integers after bit operations: ``(must, may)``, the bits every value has / any value may
        #: have (int64); tighter than the range where bits vary apart (Morton codes)
        self.bits = bits

    # what a predicate may read without depending on the values
    @property
    def dtype(self) -> torch.dtype:
        return self.lo.dtype

    @property
    def device(self) -> torch.device:
        return self.lo.device

    def is_floating_point(self) -> bool:
        return self.lo.dtype.is_floating_point

    def point(self) -> bool:
        return bool(torch.equal(self.lo, self.hi))

    def __bool__(self):
        raise Unsupported("a host read (bool) of an index tensor")

    def new_zeros(self, *size, **kwargs) -> torch.Tensor:
        """A constant (not computed from the indices), as ``Tensor.new_zeros``."""
        return self._new(0, kwargs.pop("size", size), **kwargs)

    def new_ones(self, *size, **kwargs) -> torch.Tensor:
        return self._new(1, kwargs.pop("size", size), **kwargs)

    def _new(self, fill, size, dtype=None, device=None, **kwargs) -> torch.Tensor:
        if kwargs:
            raise Unsupported(f"new tensor with {sorted(kwargs)}")
        if isinstance(size, tuple) and len(size) == 1 and not isinstance(size[0], int):
            size = size[0]  # new_ones((2, 3)) as new_ones(2, 3)
        shape = (size,) if isinstance(size, int) else tuple(size)
        return torch.full(shape, fill, dtype=dtype or self.dtype, device=device or self.device)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        rule = RULES.get(name)
        if rule is None:
            raise Unsupported(f"{name or func} has no interval rule")
        return rule(*args, **kwargs)


BLOCK_DIMS = 4  # (B, H, nq, nk); a value the predicate computes per pair has its own dims after them


def pair_dims(t: torch.Tensor) -> int:
    return max(0, t.dim() - BLOCK_DIMS)


def lift(x) -> Interval:
    """An interval for an operand: intervals as they are; numbers and constant tensors as points.
    A constant tensor of shape ``S`` is one value of shape ``S`` for every pair (as under
    ``torch.vmap``, FlexAttention's semantics): its dims come after the block dims."""
    if isinstance(x, Interval):
        return x
    if isinstance(x, bool | Number):
        t = torch.as_tensor(x)
        return Interval(t, t)
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.dim() > 0:
            t = t.view(*(1,) * BLOCK_DIMS, *t.shape)
        return Interval(t, t)
    raise Unsupported(f"an operand of type {type(x).__name__}")


def lifted(*xs) -> list[Interval]:
    """Operands lifted and their per-pair dims aligned (right-aligned, as broadcasting one pair's
    values): a value with fewer per-pair dims gets size-1 dims after its block dims."""
    ivs = [lift(x) for x in xs]
    most = max(pair_dims(iv.lo) for iv in ivs)
    out = []
    for iv in ivs:
        missing = most - pair_dims(iv.lo)
        if missing and iv.lo.dim() >= BLOCK_DIMS:
            shape = lambda t, m=missing: t.view(*t.shape[:BLOCK_DIMS], *(1,) * m, *t.shape[BLOCK_DIMS:])  # noqa: E731
            bits = None if iv.bits is None else (shape(iv.bits[0]), shape(iv.bits[1]))
            iv = Interval(shape(iv.lo), shape(iv.hi), bits)
        out.append(iv)
    return out


class _Table:
    """A captured tensor indexed by ranges: the min and max of the entries each block may read."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self.dtype = table.dtype
        self.values = table.to(torch.uint8) if table.dtype == torch.bool else table
        self._levels: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def levels(self, dim: int):
        """Sparse tables along ``dim``: level k holds the min / max of 2**k entries from each index."""
        if dim not in self._levels:
            mins, maxs = [self.values], [self.values]
            n, width = self.values.shape[dim], 1
            while 2 * width <= n:
                lo_min, lo_max = mins[-1], maxs[-1]
                shifted = lo_min.narrow(dim, width, n - width)
                pad = [lo_min.narrow(dim, n - width, width)]
                mins.append(torch.minimum(lo_min, torch.cat([shifted, *pad], dim)))
                shifted = lo_max.narrow(dim, width, n - width)
                pad = [lo_max.narrow(dim, n - width, width)]
                maxs.append(torch.maximum(lo_max, torch.cat([shifted, *pad], dim)))
                width *= 2
            self._levels[dim] = (torch.stack(mins), torch.stack(maxs))
        return self._levels[dim]

    def out(self, lo: torch.Tensor, hi: torch.Tensor) -> Interval:
        if self.dtype == torch.bool:
            return Interval(lo != 0, hi != 0)
        return Interval(lo, hi)

    def gather(self, index) -> Interval:
        parts = index if isinstance(index, tuple) else (index,)
        if len(parts) > self.table.dim() or any(p is None or p is Ellipsis or isinstance(p, slice) for p in parts):
            raise Unsupported(f"indexing a captured tensor of {self.table.dim()} dims with {len(parts)} indices")
        aligned = lifted(*parts)
        ranges = []
        for dim, iv in enumerate(aligned):
            if iv.dtype.is_floating_point or iv.dtype == torch.bool:
                raise Unsupported("indexing with a float or bool tensor")
            size = self.table.shape[dim]
            if bool((iv.lo < -size).any() | (iv.hi >= size).any()):
                raise Unsupported(f"an index range outside the {size} entries of a captured tensor")
            neg = iv.lo < 0
            if bool(neg.any()):
                if bool((neg & (iv.hi >= 0)).any()):
                    raise Unsupported("an index range that wraps around the end of a captured tensor")
                iv = Interval(torch.where(neg, iv.lo + size, iv.lo), torch.where(neg, iv.hi + size, iv.hi))
            ranges.append(iv)
        wide = [d for d, iv in enumerate(ranges) if not iv.point()]
        if not wide:
            t = self.values[tuple(iv.lo for iv in ranges)]
            return self.out(t, t)
        widths = [int((ranges[d].hi - ranges[d].lo).max()) + 1 for d in wide]
        if math.prod(widths) <= 16:  # a few entries per block: read them all
            reads = []
            offsets = torch.cartesian_prod(*[torch.arange(w) for w in widths]).reshape(-1, len(wide)).tolist()
            for step in offsets:
                at = [iv.lo for iv in ranges]
                for d, o in zip(wide, step):
                    at[d] = torch.minimum(ranges[d].lo + o, ranges[d].hi)
                reads.append(self.values[tuple(at)])
            lo, hi = reads[0], reads[0]
            for t in reads[1:]:
                lo, hi = torch.minimum(lo, t), torch.maximum(hi, t)
            return self.out(lo, hi)
        if len(wide) == 1:  # one range: two reads of a sparse table
            d = wide[0]
            mins, maxs = self.levels(d)
            length = ranges[d].hi - ranges[d].lo + 1
            k = torch.floor(torch.log2(length.double())).long().clamp(max=mins.shape[0] - 1)
            right = ranges[d].hi - (1 << k) + 1
            at_lo = [k, *(iv.lo for iv in ranges)]
            at_hi = list(at_lo)
            at_hi[d + 1] = right
            lo = torch.minimum(mins[tuple(at_lo)], mins[tuple(at_hi)])
            hi = torch.maximum(maxs[tuple(at_lo)], maxs[tuple(at_hi)])
            return self.out(lo, hi)
        # several wide ranges: the range of the entries they index (sound; such blocks are evaluated pair by pair)
        shape = torch.broadcast_shapes(*(iv.lo.shape for iv in ranges))
        flat = self.values.flatten(0, len(ranges) - 1)
        trailing = flat.shape[1:]
        lo = flat.amin(0).expand(*shape, *trailing)
        hi = flat.amax(0).expand(*shape, *trailing)
        return self.out(lo, hi)


class Tables:
    """The sparse tables made during one evaluation, by captured tensor."""

    def __init__(self):
        self.by_id: dict[int, _Table] = {}

    def __call__(self, table: torch.Tensor) -> _Table:
        found = self.by_id.get(id(table))
        if found is None or found.table is not table:
            found = self.by_id[id(table)] = _Table(table)
        return found


class _Evaluations(threading.local):
    """The tables of the evaluations under way in this thread (one per block_bounds call)."""

    def __init__(self):
        self.stack: list[Tables] = []


#: per thread: a predicate evaluated in two threads at once reads its own tables
tables = _Evaluations()


def getitem(table, index):
    if isinstance(table, Interval):  # one pair's value indexed by constants: its own dims
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, bool) or not isinstance(p, int) for p in parts) or len(parts) > pair_dims(table.lo):
            raise Unsupported("indexing a tensor computed from the indices other than by integers")
        lo, hi = table.lo, table.hi
        for p in parts:
            lo, hi = lo.select(BLOCK_DIMS, p), hi.select(BLOCK_DIMS, p)
        return Interval(lo, hi)
    if not isinstance(table, torch.Tensor):
        raise Unsupported(f"indexing a {type(table).__name__}")
    found = tables.stack[-1] if tables.stack else Tables()
    return found(table).gather(index)
