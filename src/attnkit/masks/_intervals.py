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

from collections.abc import Callable

import torch

from attnkit.masks._interval_values import (
    BLOCK_DIMS,
    RULES,
    Interval,
    Tables,
    Unsupported,
    getitem,
    lift,
    lifted,
    pair_dims,
    tables,
    top_of,
)

__all__ = ["Interval", "Unsupported", "block_bounds"]


def _corners(op: Callable, a: Interval, b: Interval) -> Interval:
    """Bounds of a function monotone in each argument on the box: the min and max of its corners."""
    values = [op(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    lo = torch.minimum(torch.minimum(values[0], values[1]), torch.minimum(values[2], values[3]))
    hi = torch.maximum(torch.maximum(values[0], values[1]), torch.maximum(values[2], values[3]))
    return Interval(lo, hi)


def _add(a, b, *, alpha=1):
    a, b = lifted(a, b)
    if alpha != 1:
        b = _mul(b, alpha)
    return Interval(a.lo + b.lo, a.hi + b.hi)


def _sub(a, b, *, alpha=1):
    a, b = lifted(a, b)
    if alpha != 1:
        b = _mul(b, alpha)
    return Interval(a.lo - b.hi, a.hi - b.lo)


def _rsub(a, b, *, alpha=1):
    return _sub(b, a, alpha=alpha)


def _mul(a, b):
    a, b = lifted(a, b)
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return _bits(a, b, "and")
    return _corners(torch.mul, a, b)


def _neg(a):
    a = lift(a)
    return Interval(-a.hi, -a.lo)


def _pos(a):
    return lift(a)


def _abs(a):
    a = lift(a)
    lo = torch.where(a.lo >= 0, a.lo, torch.where(a.hi <= 0, -a.hi, torch.zeros_like(a.lo)))
    hi = torch.maximum(a.lo.abs(), a.hi.abs())
    return Interval(lo, hi)


def _divide(a, b, rounding_mode=None, *, true_division=True):
    a, b = lifted(a, b)
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
        top_lo, top_hi = top_of(out.dtype, out.lo)
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
    a, b = lifted(a, b)
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
        a, b = lifted(a, b)
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
    a, b = lifted(a, b)
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
    a = lift(a)
    if a.dtype == torch.bool:
        return Interval(~a.hi, ~a.lo)
    if a.dtype.is_floating_point:
        raise Unsupported("~ of a float tensor")
    return Interval(~a.hi, ~a.lo)  # ~x = -x - 1: decreasing


def _shift(a, b, left: bool):
    a, b = lifted(a, b)
    if a.dtype.is_floating_point or a.dtype == torch.bool or not b.point() or bool((b.lo < 0).any()):
        raise Unsupported("a shift other than an integer range by a fixed non-negative amount")
    fn = torch.bitwise_left_shift if left else torch.bitwise_right_shift
    bits = None
    if a.bits is not None and bool((a.lo >= 0).all()):  # the known bits move with the value
        bits = (fn(a.bits[0], b.lo.long()), fn(a.bits[1], b.lo.long()))
    return Interval(fn(a.lo, b.lo), fn(a.hi, b.lo), bits)  # monotone (no overflow at index sizes)


def _minimum(a, b):
    a, b = lifted(a, b)
    return Interval(torch.minimum(a.lo, b.lo), torch.minimum(a.hi, b.hi))


def _maximum(a, b):
    a, b = lifted(a, b)
    return Interval(torch.maximum(a.lo, b.lo), torch.maximum(a.hi, b.hi))


def _clamp(a, min=None, max=None):  # noqa: A002 - torch's argument names
    out = lift(a)
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
    cond, a, b = lifted(cond, a, b)
    if cond.dtype != torch.bool:
        raise Unsupported("where with a condition that is not bool")
    lo = torch.where(cond.lo, a.lo, torch.where(~cond.hi, b.lo, torch.minimum(a.lo, b.lo)))
    hi = torch.where(cond.lo, a.hi, torch.where(~cond.hi, b.hi, torch.maximum(a.hi, b.hi)))
    return Interval(lo, hi)


def _logical(op: str):
    def rule(a, b=None):
        a = lift(a)
        a = Interval(a.lo != 0, a.hi != 0) if a.dtype == torch.bool else _cast(a, torch.bool)
        if op == "not":
            return _invert(a)
        b = lift(b)
        b = Interval(b.lo != 0, b.hi != 0) if b.dtype == torch.bool else _cast(b, torch.bool)
        return _bits(a, b, op)

    return rule


def _cast(a, dtype: torch.dtype) -> Interval:
    a = lift(a)
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
    return _cast(a, dtype) if dtype is not None else lift(a)


def _type(a, dtype=None, *args, **kwargs):
    if dtype is None or isinstance(dtype, str):
        raise Unsupported("Tensor.type without a torch.dtype")
    return _cast(a, dtype)


def _type_as(a, other):
    return _cast(a, other.dtype)


def _monotone(fn: Callable):
    def rule(a, *args, **kwargs):
        a = lift(a)
        return Interval(fn(a.lo, *args, **kwargs), fn(a.hi, *args, **kwargs))

    return rule


def _same(a, *args, **kwargs):
    return lift(a)


def _filled(fill: Callable):
    def rule(a, *args, dtype=None, **kwargs):
        a = lift(a)
        t = fill(a.lo, *args, dtype=dtype) if dtype is not None else fill(a.lo, *args)
        return Interval(t, t)

    return rule


def _square(a):
    a = _abs(a)
    return Interval(a.lo * a.lo, a.hi * a.hi)


def _pair_dim(iv: Interval, dim: int, extra: int = 0) -> int:
    """A dim of one pair's value (``dim`` as the predicate sees it) as a dim of the block tensors."""
    pair = pair_dims(iv.lo) + extra
    if not -pair <= dim < pair:
        raise Unsupported(f"dim {dim} of a value with {pair - extra} dims per pair")
    return dim + BLOCK_DIMS if dim >= 0 else iv.lo.dim() + extra + dim


def _reduction(kind: str):
    def rule(a, dim=None, keepdim=False, **kwargs):
        a = lift(a)
        if kwargs:
            raise Unsupported(f"{kind} with {sorted(kwargs)}")
        pair = pair_dims(a.lo)
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
    a = lift(a)
    if a.lo.dim() < BLOCK_DIMS:
        raise Unsupported("unsqueeze of a constant")
    d = _pair_dim(a, dim, extra=1)
    return Interval(a.lo.unsqueeze(d), a.hi.unsqueeze(d))


def _squeeze(a, dim=None):
    a = lift(a)
    if dim is None:
        raise Unsupported("squeeze without a dim")
    d = _pair_dim(a, dim)
    return Interval(a.lo.squeeze(d), a.hi.squeeze(d))


_RULES = RULES  # the registry Interval dispatches through
_RULES.update(
    {
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
        "__getitem__": getitem,
        "any": _reduction("any"),
        "all": _reduction("all"),
        "amin": _reduction("amin"),
        "amax": _reduction("amax"),
        "sum": _reduction("sum"),
        "unsqueeze": _unsqueeze,
        "squeeze": _squeeze,
    }
)

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


setattr(Interval, "__getitem__", getitem)  # noqa: B010 - one pair's values indexed by constants


def _floor_dunder(self):
    return _RULES["floor"](self)


Interval.__floor__ = _floor_dunder  # type: ignore[attr-defined]  # math.floor(x)
Interval.__ceil__ = lambda self: _RULES["ceil"](self)  # type: ignore[attr-defined]
Interval.__trunc__ = lambda self: _RULES["trunc"](self)  # type: ignore[attr-defined]


def block_bounds(fn: Callable, b: Interval, h: Interval, q: Interval, kv: Interval) -> Interval:
    """``fn`` on index ranges: a bool :class:`Interval` per block. Raises :class:`Unsupported`."""
    tables.stack.append(Tables())
    try:
        out = fn(b, h, q, kv)
    except Unsupported:
        raise
    except Exception as err:  # noqa: BLE001 - anything else the predicate does on ranges: the other path
        raise Unsupported(f"{type(err).__name__}: {err}") from err
    finally:
        tables.stack.pop()
    if isinstance(out, bool) or (isinstance(out, torch.Tensor) and out.dtype == torch.bool):
        out = lift(out)
    if not isinstance(out, Interval) or out.dtype != torch.bool or pair_dims(out.lo) or pair_dims(out.hi):
        raise Unsupported("the predicate does not return one bool per pair")
    return out
