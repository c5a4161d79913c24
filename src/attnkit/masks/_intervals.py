"""A predicate's block map from its index *ranges*: interval arithmetic over blocks.

A ``from_fn`` predicate ``fn(b, h, q_idx, kv_idx)`` that is proved elementwise
(:mod:`attnkit._pointwise`) is run once more on :class:`Interval` values: ``q_idx`` is, for each
block of queries, the range ``[first, last]`` of its indices (shape ``(B or 1, 1, nq, 1)``),
``kv_idx`` the same for each block of keys ``(1, 1, 1, nk)``, ``b`` and ``h`` single values.
Every operation of the expression language (comparisons, integer and float arithmetic, floor
division and remainder, bit operations, logic, ``where``, ``clamp``/``minimum``/``maximum``, casts,
and indexing a captured tensor) maps ranges to a range that holds every value the operation can
take on the block: a sound bound, computed for all ``nq x nk`` blocks of every head at once. Where
a block's bool result is ``[True, True]`` every pair is allowed (FULL), ``[False, False]`` none is
(EMPTY); the blocks left undecided (the mask's edges, and any block where a bound is loose) are
evaluated pair by pair, all of them in one batched call of the predicate, chunked. The work is
``O(nq x nk)`` plus the undecided blocks' pairs, where evaluating every pair is ``O(Lq x Lk)``.

An operation outside the language raises :class:`Unsupported` and the caller evaluates every row of
blocks instead (the answer is the same; only the time differs). Indexing with a range that leaves
the table raises it too, so a predicate that would fail pair by pair fails the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Number

import torch

__all__ = ["Interval", "Unsupported", "block_bounds"]


class Unsupported(Exception):
    """An operation interval arithmetic does not bound; the caller takes the pair-by-pair path."""


def _top(dtype: torch.dtype, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        rule = _RULES.get(name)
        if rule is None:
            raise Unsupported(f"{name or func} has no interval rule")
        return rule(*args, **kwargs)


BLOCK_DIMS = 4  # (B, H, nq, nk); a value the predicate computes per pair has its own dims after them


def _pair_dims(t: torch.Tensor) -> int:
    return max(0, t.dim() - BLOCK_DIMS)


def _lift(x) -> Interval:
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


def _lifted(*xs) -> list[Interval]:
    """Operands lifted and their per-pair dims aligned (right-aligned, as broadcasting one pair's
    values): a value with fewer per-pair dims gets size-1 dims after its block dims."""
    ivs = [_lift(x) for x in xs]
    most = max(_pair_dims(iv.lo) for iv in ivs)
    out = []
    for iv in ivs:
        missing = most - _pair_dims(iv.lo)
        if missing and iv.lo.dim() >= BLOCK_DIMS:
            shape = lambda t, m=missing: t.view(*t.shape[:BLOCK_DIMS], *(1,) * m, *t.shape[BLOCK_DIMS:])  # noqa: E731
            bits = None if iv.bits is None else (shape(iv.bits[0]), shape(iv.bits[1]))
            iv = Interval(shape(iv.lo), shape(iv.hi), bits)
        out.append(iv)
    return out


def _corners(op: Callable, a: Interval, b: Interval) -> Interval:
    """Bounds of a function monotone in each argument on the box: the min and max of its corners."""
    values = [op(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    lo = torch.minimum(torch.minimum(values[0], values[1]), torch.minimum(values[2], values[3]))
    hi = torch.maximum(torch.maximum(values[0], values[1]), torch.maximum(values[2], values[3]))
    return Interval(lo, hi)


def _add(a, b, *, alpha=1):
    a, b = _lifted(a, b)
    if alpha != 1:
        b = _mul(b, alpha)
    return Interval(a.lo + b.lo, a.hi + b.hi)


def _sub(a, b, *, alpha=1):
    a, b = _lifted(a, b)
    if alpha != 1:
        b = _mul(b, alpha)
    return Interval(a.lo - b.hi, a.hi - b.lo)


def _rsub(a, b, *, alpha=1):
    return _sub(b, a, alpha=alpha)


def _mul(a, b):
    a, b = _lifted(a, b)
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return _bits(a, b, "and")
    return _corners(torch.mul, a, b)


def _neg(a):
    a = _lift(a)
    return Interval(-a.hi, -a.lo)


def _pos(a):
    return _lift(a)


def _abs(a):
    a = _lift(a)
    lo = torch.where(a.lo >= 0, a.lo, torch.where(a.hi <= 0, -a.hi, torch.zeros_like(a.lo)))
    hi = torch.maximum(a.lo.abs(), a.hi.abs())
    return Interval(lo, hi)


def _divide(a, b, rounding_mode=None, *, true_division=True):
    a, b = _lifted(a, b)
    if a.dtype == torch.bool or b.dtype == torch.bool:
        raise Unsupported("division of bool tensors")
    zero = (b.lo <= 0) & (b.hi >= 0)  # a divisor range holding 0 bounds nothing
    if rounding_mode is None and not true_division:
        rounding_mode = "floor"
    if rounding_mode == "floor":

        def op(x, y):
            return torch.div(x, y.masked_fill(zero, 1), rounding_mode="floor")
    elif rounding_mode == "trunc":

        def op(x, y):
            return torch.div(x, y.masked_fill(zero, 1), rounding_mode="trunc")
    elif rounding_mode is None:

        def op(x, y):
            return torch.true_divide(x, y.masked_fill(zero, 1))
    else:
        raise Unsupported(f"rounding_mode={rounding_mode!r}")
    out = _corners(op, a, b)
    if bool(zero.any()):
        top_lo, top_hi = _top(out.dtype, out.lo)
        out = Interval(torch.where(zero, top_lo, out.lo), torch.where(zero, top_hi, out.hi))
    return out


def _true_divide(a, b, rounding_mode=None):
    return _divide(a, b, rounding_mode)


def _floor_divide(a, b):
    return _divide(a, b, "floor")


def _rtruediv(a, b):
    return _divide(b, a)


def _rfloordiv(a, b):
    return _divide(b, a, "floor")


def _remainder(a, b, *, fmod: bool = False):
    a, b = _lifted(a, b)
    if a.dtype == torch.bool or b.dtype == torch.bool:
        raise Unsupported("remainder of bool tensors")
    if not bool((b.lo > 0).all()):
        raise Unsupported("a remainder by a divisor that may be 0 or negative")
    floating = a.dtype.is_floating_point or b.dtype.is_floating_point
    nonneg = a.lo >= 0
    if fmod and not bool(nonneg.all()):
        raise Unsupported("fmod of a dividend that may be negative")
    # one divisor and one period: the remainder is the dividend shifted, monotone on the block
    period = torch.div(a.lo, b.lo, rounding_mode="floor") == torch.div(a.hi, b.lo, rounding_mode="floor")
    same = (b.lo == b.hi) & period
    widest_hi = b.hi if floating else b.hi - 1
    lo = torch.where(same, torch.remainder(a.lo, b.lo), torch.zeros_like(torch.remainder(a.lo, b.lo)))
    hi = torch.where(same, torch.remainder(a.hi, b.lo), widest_hi.to(lo.dtype))
    hi = torch.where(nonneg, torch.minimum(hi, a.hi.to(hi.dtype)), hi)
    return Interval(lo, hi)


def _fmod(a, b):
    return _remainder(a, b, fmod=True)


def _rmod(a, b):
    return _remainder(b, a)


def _compare(kind: str):
    def rule(a, b):
        a, b = _lifted(a, b)
        if kind == "ge":
            sure, never = a.lo >= b.hi, a.hi < b.lo
        elif kind == "gt":
            sure, never = a.lo > b.hi, a.hi <= b.lo
        elif kind == "le":
            sure, never = a.hi <= b.lo, a.lo > b.hi
        elif kind == "lt":
            sure, never = a.hi < b.lo, a.lo >= b.hi
        else:
            equal = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
            apart = (a.hi < b.lo) | (b.hi < a.lo)
            sure, never = (equal, apart) if kind == "eq" else (apart, equal)
        return Interval(sure, ~never)

    return rule


def _bits(a, b, op: str):
    """Bit operations on integers: exact on single values, bounded for non-negative ranges."""
    a, b = _lifted(a, b)
    if a.dtype == torch.bool and b.dtype == torch.bool:
        if op == "and":
            return Interval(a.lo & b.lo, a.hi & b.hi)
        if op == "or":
            return Interval(a.lo | b.lo, a.hi | b.hi)
        sure = (a.lo & ~b.hi) | (~a.hi & b.lo)  # one surely True, the other surely False
        never = (a.lo & b.lo) | (~a.hi & ~b.hi)
        return Interval(sure, ~never)
    if a.dtype.is_floating_point or b.dtype.is_floating_point or a.dtype == torch.bool or b.dtype == torch.bool:
        raise Unsupported(f"bitwise {op} of {a.dtype} and {b.dtype}")
    # known bits: above the highest bit that varies in a range, every value shares lo's bits
    nonneg = (a.lo >= 0) & (b.lo >= 0)
    if not bool(((a.lo == a.hi) & (b.lo == b.hi) | nonneg).all()):
        raise Unsupported(f"bitwise {op} of ranges that may be negative")
    (must_a, may_a), (must_b, may_b) = _known(a), _known(b)
    if op == "and":
        must, may = must_a & must_b, may_a & may_b
    elif op == "or":
        must, may = must_a | must_b, may_a | may_b
    else:  # a bit is known where it is known in both
        must = (must_a & ~may_b) | (~may_a & must_b)
        may = (may_a | may_b) & ~(must_a & must_b)
    dtype = torch.promote_types(a.dtype, b.dtype)
    lo, hi = must, may  # single values (negative ones too): exact; else non-negative, and must <= x <= may
    if op == "and":  # never above either operand
        hi = torch.where(nonneg, torch.minimum(hi, torch.minimum(a.hi, b.hi).long()), hi)
    elif op == "or":  # at least either operand, at most their sum
        lo = torch.where(nonneg, torch.maximum(lo, torch.maximum(a.lo, b.lo).long()), lo)
        hi = torch.where(nonneg, torch.minimum(hi, (a.hi + b.hi).long()), hi)
    return Interval(lo.to(dtype), hi.to(dtype), (must, may))


def _known(iv: Interval) -> tuple[torch.Tensor, torch.Tensor]:
    """``(must, may)`` bits of an integer interval (non-negative, or a single value): its own where
    bit operations made it, else from its range."""
    if iv.bits is not None:
        return iv.bits
    lo, hi = iv.lo.long(), iv.hi.long()
    low = _smear(lo ^ hi)
    fixed = lo & ~low
    return fixed, fixed | low


def _smear(d: torch.Tensor) -> torch.Tensor:
    """Every bit at or below the highest set bit of ``d`` (non-negative int64) set."""
    for shift in (1, 2, 4, 8, 16, 32):
        d = d | (d >> shift)
    return d


def _invert(a):
    a = _lift(a)
    if a.dtype == torch.bool:
        return Interval(~a.hi, ~a.lo)
    if a.dtype.is_floating_point:
        raise Unsupported("~ of a float tensor")
    return Interval(~a.hi, ~a.lo)  # ~x = -x - 1: decreasing


def _shift(a, b, left: bool):
    a, b = _lifted(a, b)
    if a.dtype.is_floating_point or a.dtype == torch.bool or not b.point() or bool((b.lo < 0).any()):
        raise Unsupported("a shift other than an integer range by a fixed non-negative amount")
    fn = torch.bitwise_left_shift if left else torch.bitwise_right_shift
    bits = None
    if a.bits is not None and bool((a.lo >= 0).all()):  # the known bits move with the value
        bits = (fn(a.bits[0], b.lo.long()), fn(a.bits[1], b.lo.long()))
    return Interval(fn(a.lo, b.lo), fn(a.hi, b.lo), bits)  # monotone (no overflow at index sizes)


def _minimum(a, b):
    a, b = _lifted(a, b)
    return Interval(torch.minimum(a.lo, b.lo), torch.minimum(a.hi, b.hi))


def _maximum(a, b):
    a, b = _lifted(a, b)
    return Interval(torch.maximum(a.lo, b.lo), torch.maximum(a.hi, b.hi))


def _clamp(a, min=None, max=None):  # noqa: A002 - torch's argument names
    out = _lift(a)
    if min is not None:
        out = _maximum(out, min)
    if max is not None:
        out = _minimum(out, max)
    return out


def _clamp_min(a, min):  # noqa: A002
    return _clamp(a, min=min)


def _clamp_max(a, max):  # noqa: A002
    return _clamp(a, max=max)


def _where(cond, a, b):
    cond, a, b = _lifted(cond, a, b)
    if cond.dtype != torch.bool:
        raise Unsupported("where with a condition that is not bool")
    lo = torch.where(cond.lo, a.lo, torch.where(~cond.hi, b.lo, torch.minimum(a.lo, b.lo)))
    hi = torch.where(cond.lo, a.hi, torch.where(~cond.hi, b.hi, torch.maximum(a.hi, b.hi)))
    return Interval(lo, hi)


def _logical(op: str):
    def rule(a, b=None):
        a = _lift(a)
        a = Interval(a.lo != 0, a.hi != 0) if a.dtype == torch.bool else _cast(a, torch.bool)
        if op == "not":
            return _invert(a)
        b = _lift(b)
        b = Interval(b.lo != 0, b.hi != 0) if b.dtype == torch.bool else _cast(b, torch.bool)
        return _bits(a, b, op)

    return rule


def _cast(a, dtype: torch.dtype) -> Interval:
    a = _lift(a)
    if dtype == a.dtype:
        return a
    if dtype == torch.bool:  # x != 0
        zero = torch.zeros((), dtype=a.dtype, device=a.lo.device)
        sure = (a.lo > zero) | (a.hi < zero)
        never = (a.lo == zero) & (a.hi == zero)
        return Interval(sure, ~never)
    if not dtype.is_floating_point and a.dtype.is_floating_point:
        info = torch.iinfo(dtype)
        if bool((a.lo < info.min).any() | (a.hi > info.max).any() | a.lo.isinf().any() | a.hi.isinf().any()):
            raise Unsupported(f"a float range that does not fit {dtype}")
    if not dtype.is_floating_point and dtype != torch.bool and not a.dtype.is_floating_point:
        info = torch.iinfo(dtype)
        if bool((a.lo < info.min).any() | (a.hi > info.max).any()):
            raise Unsupported(f"an integer range that wraps in {dtype}")
    return Interval(a.lo.to(dtype), a.hi.to(dtype))  # casts are monotone (truncation too)


def _to(a, *args, **kwargs):
    dtype = kwargs.get("dtype")
    for x in args:
        if isinstance(x, torch.dtype):
            dtype = x
        elif isinstance(x, torch.Tensor | Interval):
            dtype = x.dtype
    return _cast(a, dtype) if dtype is not None else _lift(a)


def _type(a, dtype=None, *args, **kwargs):
    if dtype is None or isinstance(dtype, str):
        raise Unsupported("Tensor.type without a torch.dtype")
    return _cast(a, dtype)


def _type_as(a, other):
    return _cast(a, other.dtype)


def _monotone(fn: Callable):
    def rule(a, *args, **kwargs):
        a = _lift(a)
        return Interval(fn(a.lo, *args, **kwargs), fn(a.hi, *args, **kwargs))

    return rule


def _same(a, *args, **kwargs):
    return _lift(a)


def _filled(fill: Callable):
    def rule(a, *args, dtype=None, **kwargs):
        a = _lift(a)
        t = fill(a.lo, *args, dtype=dtype) if dtype is not None else fill(a.lo, *args)
        return Interval(t, t)

    return rule


def _square(a):
    a = _abs(a)
    return Interval(a.lo * a.lo, a.hi * a.hi)


def _pair_dim(iv: Interval, dim: int, extra: int = 0) -> int:
    """A dim of one pair's value (``dim`` as the predicate sees it) as a dim of the block tensors."""
    pair = _pair_dims(iv.lo) + extra
    if not -pair <= dim < pair:
        raise Unsupported(f"dim {dim} of a value with {pair - extra} dims per pair")
    return dim + BLOCK_DIMS if dim >= 0 else iv.lo.dim() + extra + dim


def _reduction(kind: str):
    def rule(a, dim=None, keepdim=False, **kwargs):
        a = _lift(a)
        if kwargs:
            raise Unsupported(f"{kind} with {sorted(kwargs)}")
        pair = _pair_dims(a.lo)
        if dim is None:
            dims = list(range(BLOCK_DIMS, BLOCK_DIMS + pair))
        else:
            dims = [_pair_dim(a, d) for d in (dim if isinstance(dim, tuple | list) else (dim,))]
        if not dims:
            return a
        if kind in ("any", "all"):
            if a.dtype != torch.bool:
                a = _cast(a, torch.bool)
            fn = torch.any if kind == "any" else torch.all
            lo, hi = a.lo, a.hi
            for d in sorted(dims, reverse=True):
                lo, hi = fn(lo, dim=d, keepdim=keepdim), fn(hi, dim=d, keepdim=keepdim)
            return Interval(lo, hi)
        fn = {"amin": torch.amin, "amax": torch.amax, "sum": torch.sum}[kind]
        if kind == "sum" and a.dtype == torch.bool:
            a = _cast(a, torch.int64)
        return Interval(fn(a.lo, dim=dims, keepdim=keepdim), fn(a.hi, dim=dims, keepdim=keepdim))

    return rule


def _unsqueeze(a, dim):
    a = _lift(a)
    if a.lo.dim() < BLOCK_DIMS:
        raise Unsupported("unsqueeze of a constant")
    d = _pair_dim(a, dim, extra=1)
    return Interval(a.lo.unsqueeze(d), a.hi.unsqueeze(d))


def _squeeze(a, dim=None):
    a = _lift(a)
    if dim is None:
        raise Unsupported("squeeze without a dim")
    d = _pair_dim(a, dim)
    return Interval(a.lo.squeeze(d), a.hi.squeeze(d))


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
        lifted = _lifted(*parts)
        ranges = []
        for dim, iv in enumerate(lifted):
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


class _Tables:
    """The sparse tables made during one evaluation, by captured tensor."""

    def __init__(self):
        self.by_id: dict[int, _Table] = {}

    def __call__(self, table: torch.Tensor) -> _Table:
        found = self.by_id.get(id(table))
        if found is None or found.table is not table:
            found = self.by_id[id(table)] = _Table(table)
        return found


_TABLES: list[_Tables] = []


def _getitem(table, index):
    if isinstance(table, Interval):  # one pair's value indexed by constants: its own dims
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, bool) or not isinstance(p, int) for p in parts) or len(parts) > _pair_dims(table.lo):
            raise Unsupported("indexing a tensor computed from the indices other than by integers")
        lo, hi = table.lo, table.hi
        for p in parts:
            lo, hi = lo.select(BLOCK_DIMS, p), hi.select(BLOCK_DIMS, p)
        return Interval(lo, hi)
    if not isinstance(table, torch.Tensor):
        raise Unsupported(f"indexing a {type(table).__name__}")
    tables = _TABLES[-1] if _TABLES else _Tables()
    return tables(table).gather(index)


_RULES: dict[str, Callable] = {
    "add": _add,
    "radd": _add,
    "sub": _sub,
    "subtract": _sub,
    "rsub": _rsub,
    "mul": _mul,
    "rmul": _mul,
    "multiply": _mul,
    "neg": _neg,
    "negative": _neg,
    "pos": _pos,
    "abs": _abs,
    "absolute": _abs,
    "div": _divide,
    "divide": _divide,
    "true_divide": _true_divide,
    "truediv": _true_divide,
    "rtruediv": _rtruediv,
    "floor_divide": _floor_divide,
    "floordiv": _floor_divide,
    "rfloordiv": _rfloordiv,
    "remainder": _remainder,
    "mod": _remainder,
    "rmod": _rmod,
    "fmod": _fmod,
    "ge": _compare("ge"),
    "greater_equal": _compare("ge"),
    "gt": _compare("gt"),
    "greater": _compare("gt"),
    "le": _compare("le"),
    "less_equal": _compare("le"),
    "lt": _compare("lt"),
    "less": _compare("lt"),
    "eq": _compare("eq"),
    "ne": _compare("ne"),
    "not_equal": _compare("ne"),
    "and": lambda a, b: _bits(a, b, "and"),
    "rand": lambda a, b: _bits(b, a, "and"),
    "bitwise_and": lambda a, b: _bits(a, b, "and"),
    "or": lambda a, b: _bits(a, b, "or"),
    "ror": lambda a, b: _bits(b, a, "or"),
    "bitwise_or": lambda a, b: _bits(a, b, "or"),
    "xor": lambda a, b: _bits(a, b, "xor"),
    "rxor": lambda a, b: _bits(b, a, "xor"),
    "bitwise_xor": lambda a, b: _bits(a, b, "xor"),
    "invert": _invert,
    "bitwise_not": _invert,
    "lshift": lambda a, b: _shift(a, b, True),
    "bitwise_left_shift": lambda a, b: _shift(a, b, True),
    "rshift": lambda a, b: _shift(a, b, False),
    "bitwise_right_shift": lambda a, b: _shift(a, b, False),
    "logical_and": _logical("and"),
    "logical_or": _logical("or"),
    "logical_xor": _logical("xor"),
    "logical_not": _logical("not"),
    "minimum": _minimum,
    "maximum": _maximum,
    "clamp": _clamp,
    "clip": _clamp,
    "clamp_min": _clamp_min,
    "clamp_max": _clamp_max,
    "where": _where,
    "to": _to,
    "type": _type,
    "type_as": _type_as,
    "long": lambda a: _cast(a, torch.int64),
    "int": lambda a: _cast(a, torch.int32),
    "short": lambda a: _cast(a, torch.int16),
    "float": lambda a: _cast(a, torch.float32),
    "double": lambda a: _cast(a, torch.float64),
    "bool": lambda a: _cast(a, torch.bool),
    "floor": _monotone(torch.floor),
    "ceil": _monotone(torch.ceil),
    "round": _monotone(torch.round),
    "trunc": _monotone(torch.trunc),
    "fix": _monotone(torch.trunc),
    "sign": _monotone(torch.sign),
    "sgn": _monotone(torch.sign),
    "square": _square,
    "clone": _same,
    "detach": _same,
    "contiguous": _same,
    "zeros_like": _filled(torch.zeros_like),
    "ones_like": _filled(torch.ones_like),
    "full_like": _filled(torch.full_like),
    "__getitem__": _getitem,
    "any": _reduction("any"),
    "all": _reduction("all"),
    "amin": _reduction("amin"),
    "amax": _reduction("amax"),
    "sum": _reduction("sum"),
    "unsqueeze": _unsqueeze,
    "squeeze": _squeeze,
}

# Python operators on an Interval (the left operand): routed through the same rules
for _op in (
    "add radd sub rsub mul rmul neg pos abs truediv rtruediv floordiv rfloordiv mod rmod "
    "ge gt le lt eq ne and rand or ror xor rxor invert lshift rshift"
).split():
    setattr(Interval, f"__{_op}__", lambda self, *args, _op=_op: _RULES[_op](self, *args))
_METHODS = (
    "clamp clip clamp_min clamp_max where to type type_as long int short float double bool floor ceil round trunc "
    "sign square clone detach contiguous abs neg logical_and logical_or logical_xor logical_not bitwise_and "
    "bitwise_or bitwise_xor bitwise_not remainder fmod div floor_divide minimum maximum eq ne lt le gt ge add sub "
    "mul any all amin amax sum unsqueeze squeeze"
)
for _op in _METHODS.split():
    setattr(Interval, _op, lambda self, *args, _op=_op, **kwargs: _RULES[_op](self, *args, **kwargs))


setattr(Interval, "__getitem__", _getitem)  # noqa: B010 - one pair's values indexed by constants


def _floor_dunder(self):
    return _RULES["floor"](self)


Interval.__floor__ = _floor_dunder  # type: ignore[attr-defined]  # math.floor(x)
Interval.__ceil__ = lambda self: _RULES["ceil"](self)  # type: ignore[attr-defined]
Interval.__trunc__ = lambda self: _RULES["trunc"](self)  # type: ignore[attr-defined]


def block_bounds(fn: Callable, b: Interval, h: Interval, q: Interval, kv: Interval) -> Interval:
    """``fn`` on index ranges: a bool :class:`Interval` per block. Raises :class:`Unsupported`."""
    _TABLES.append(_Tables())
    try:
        out = fn(b, h, q, kv)
    except Unsupported:
        raise
    except Exception as err:  # noqa: BLE001 - anything else the predicate does on ranges: the other path
        raise Unsupported(f"{type(err).__name__}: {err}") from err
    finally:
        _TABLES.pop()
    if isinstance(out, bool) or (isinstance(out, torch.Tensor) and out.dtype == torch.bool):
        out = _lift(out)
    if not isinstance(out, Interval) or out.dtype != torch.bool or _pair_dims(out.lo) or _pair_dims(out.hi):
        raise Unsupported("the predicate does not return one bool per pair")
    return out
