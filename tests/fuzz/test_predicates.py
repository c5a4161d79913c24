"""Random predicates of the expression language (attnkit/masks/_intervals.py): their block maps
from index ranges against the predicate evaluated one pair at a time (torch's ``create_mask``,
torch.vmap), bit for bit, at random lengths and block sizes. A predicate the ranges cannot bound
takes the pair-by-pair path and must agree as well."""

from __future__ import annotations

import operator
from unittest import mock

import pytest
import torch
from hypothesis import event, given, note
from hypothesis import strategies as st

import attnkit
from attnkit import _cache, masks
from attnkit.masks import _from_fn
from attnkit.masks._base import Blocks
from attnkit.masks._codes import EMPTY, FULL, PARTIAL

flex_module = pytest.importorskip("torch.nn.attention.flex_attention")

B, H, N = 2, 3, 300  # sequences, heads, entries of the captured tables
G = torch.Generator().manual_seed(0)
TABLE = torch.randint(0, 6, (N,), generator=G)
SORTED = torch.sort(torch.randint(0, 5, (N,), generator=G)).values  # document ids
PER_HEAD = torch.randint(-20, 40, (H,), generator=G)
FLAGS = torch.rand(B, N, generator=G) < 0.1

COMPARE = {
    "ge": operator.ge,
    "gt": operator.gt,
    "le": operator.le,
    "lt": operator.lt,
    "eq": operator.eq,
    "ne": operator.ne,
}


def _leaf():
    return st.one_of(st.sampled_from(["q", "kv", "b", "h"]), st.integers(-5, 40).map(lambda c: ("const", c)))


def _ints(children):
    small = st.integers(1, 17)
    return st.one_of(
        st.tuples(st.sampled_from(["add", "sub", "min", "max"]), children, children),
        st.tuples(st.just("mul"), children, st.integers(-3, 3)),
        st.tuples(st.sampled_from(["floordiv", "mod"]), children, small),
        st.tuples(st.sampled_from(["abs", "neg", "table", "sorted", "per_head"]), children),
        st.tuples(st.just("clamp"), children, st.integers(-10, 10), st.integers(10, 60)),
        st.tuples(st.just("shr"), children, st.integers(0, 3)),
        st.tuples(st.just("bitand"), children, st.integers(0, 15)),
        st.tuples(st.sampled_from(["bitand2", "bitor", "bitxor"]), children, children),
        st.tuples(st.just("shl"), children, st.integers(0, 3)),
        st.tuples(st.just("where"), _bools(children), children, children),
        st.tuples(st.just("float_div"), children, st.sampled_from([2.0, 3.5, -4.0])),
    )


def _bools(ints):
    return st.one_of(
        st.tuples(st.just("cmp"), st.sampled_from(list(COMPARE)), ints, ints),
        st.tuples(st.just("flag"), ints),
    )


INTS = st.recursive(_leaf(), _ints, max_leaves=6)


@st.composite
def predicates(draw):
    """A bool expression: comparisons of integer expressions combined with & | ^ ~."""
    parts = draw(st.lists(_bools(INTS), min_size=1, max_size=3))
    ops = draw(st.lists(st.sampled_from(["and", "or", "xor"]), min_size=len(parts) - 1, max_size=len(parts) - 1))
    negate = draw(st.lists(st.booleans(), min_size=len(parts), max_size=len(parts)))
    return parts, ops, negate


def _index(x):
    return x.clamp(0, N - 1)


def _tensor(x):
    """A constant leaf as a tensor (the index tensors, or what stands for them, as they are)."""
    return torch.as_tensor(x) if isinstance(x, int | float | bool) else x


def value(node, b, h, q, kv):
    if isinstance(node, str):
        return {"q": q, "kv": kv, "b": b, "h": h}[node]
    kind, *args = node
    if kind == "const":
        return args[0]
    if kind == "cmp":
        return COMPARE[args[0]](_tensor(value(args[1], b, h, q, kv)), _tensor(value(args[2], b, h, q, kv)))
    if kind == "flag":
        return FLAGS[b, _index(_tensor(value(args[0], b, h, q, kv)))]
    x = value(args[0], b, h, q, kv)
    x = _tensor(x)
    if kind == "where":
        return torch.where(x, value(args[1], b, h, q, kv), value(args[2], b, h, q, kv))
    if kind in ("add", "sub", "min", "max"):
        y = value(args[1], b, h, q, kv)
        y = _tensor(y)
        return {"add": torch.add, "sub": torch.sub, "min": torch.minimum, "max": torch.maximum}[kind](x, y)
    if kind == "mul":
        return x * args[1]
    if kind == "floordiv":
        return x // args[1]
    if kind == "mod":
        return x % args[1]
    if kind == "abs":
        return x.abs()
    if kind == "neg":
        return -x
    if kind == "table":
        return TABLE[_index(x)]
    if kind == "sorted":
        return SORTED[_index(x)]
    if kind == "per_head":
        return PER_HEAD[h] + x
    if kind == "clamp":
        return x.clamp(args[1], args[2])
    if kind == "shr":
        return x >> args[1]
    if kind == "bitand":
        return x & args[1]
    if kind in ("bitand2", "bitor", "bitxor"):
        y = _tensor(value(args[1], b, h, q, kv))
        return {"bitand2": torch.bitwise_and, "bitor": torch.bitwise_or, "bitxor": torch.bitwise_xor}[kind](x, y)
    if kind == "shl":
        return x << args[1]
    if kind == "float_div":
        return torch.floor(x.double() / args[1]).long()
    raise AssertionError(kind)


def predicate(tree):
    parts, ops, negate = tree

    def fn(b, h, q, kv):
        out = None
        for part, op, neg in zip(parts, [None, *ops], negate):
            x = value(part, b, h, q, kv)
            x = ~x if neg else x
            out = x if out is None else {"and": operator.and_, "or": operator.or_, "xor": operator.xor}[op](out, x)
        return out

    return fn


def codes_of_pairs(allowed, bq, bk):
    lq, lk = allowed.shape[-2:]
    pad = (0, -lk % bk, 0, -lq % bq)

    def tiles(fill):
        return torch.nn.functional.pad(allowed, pad, value=fill).unflatten(-1, (-1, bk)).unflatten(2, (-1, bq))

    full = tiles(True).all(-1).all(-2)
    some = tiles(False).any(-1).any(-2)
    return torch.where(full, FULL, torch.where(some, PARTIAL, EMPTY)).to(torch.int8)


@given(
    predicates(),
    st.integers(1, 200),
    st.integers(1, 200),
    st.sampled_from([(16, 16), (32, 16), (128, 64), (64, 32), (24, 40)]),
)
def test_random_predicates_block_maps_by_ranges_equal_pair_by_pair(tree, lq, lk, blocks):
    fn = predicate(tree)
    note(repr(tree))
    bq, bk = blocks
    allowed = flex_module.create_mask(fn, B, H, lq, lk, device="cpu")
    truth = codes_of_pairs(allowed, bq, bk)
    mask = masks.from_fn(fn, batch_size=B, num_heads=H)
    found = mask._codes_by_ranges(Blocks(lq, lk, bq, bk))
    event("by ranges" if found is not None else "pair by pair (outside the language)")
    if found is not None:
        assert torch.equal(found.expand_as(truth), truth)
    assert torch.equal(mask.block_map(lq, lk, bq, bk).expand_as(truth), truth)
    with mock.patch.object(_from_fn, "RANGES_FROM", 0):  # the partial tiles' bits by ranges too, at any size
        _cache.clear()  # made again, not read from the plan cache
        prepared = attnkit.prepare(masks.from_fn(fn, batch_size=B, num_heads=H), lq, lk, block_size=blocks)
    assert torch.equal(prepared.materialize().expand_as(allowed), allowed)


def _per_pair(fn, lq, lk):
    """fn over every (b, h, q, kv) under torch.vmap, one pair at a time: (B, H, lq, lk)."""
    f = torch.vmap(fn, in_dims=(None, None, None, 0))
    f = torch.vmap(f, in_dims=(None, None, 0, None))
    f = torch.vmap(f, in_dims=(None, 0, None, None))
    f = torch.vmap(f, in_dims=(0, None, None, None))
    return f(torch.arange(B), torch.arange(H), torch.arange(lq), torch.arange(lk))


@given(INTS, st.integers(1, 60), st.integers(1, 60), st.integers(1, 9), st.integers(1, 9))
def test_the_ranges_of_random_integer_expressions_hold_every_value(tree, lq, lk, sq, sk):
    """Soundness of the interval rules themselves: over parts of ``sq x sk`` pairs, every value the
    expression takes lies within the bounds its ranges give."""
    from attnkit.masks._intervals import Interval, Unsupported, block_bounds

    note(repr(tree))
    values = _per_pair(lambda b, h, q, kv: _tensor(value(tree, b, h, q, kv)).long() + 0 * q, lq, lk)
    got = {}

    def keep(b, h, q, kv):
        got["out"] = _tensor(value(tree, b, h, q, kv))
        return q >= kv  # a bool for block_bounds; the expression's own bounds are kept above

    nq, nk = -(-lq // sq), -(-lk // sk)
    q0, k0 = torch.arange(nq) * sq, torch.arange(nk) * sk
    q = Interval(q0.view(1, 1, -1, 1), (q0 + sq).clamp(max=lq).sub(1).view(1, 1, -1, 1))
    kv = Interval(k0.view(1, 1, 1, -1), (k0 + sk).clamp(max=lk).sub(1).view(1, 1, 1, -1))
    bs, hs = torch.arange(B).view(-1, 1, 1, 1), torch.arange(H).view(1, -1, 1, 1)
    try:
        block_bounds(keep, Interval(bs, bs), Interval(hs, hs), q, kv)
    except Unsupported:
        event("outside the language")
        return
    out = got["out"]
    out = out if isinstance(out, Interval) else Interval(out, out)  # a constant: its own bounds
    lo, hi = (torch.as_tensor(x).long().expand(B, H, nq, nk) for x in (out.lo, out.hi))
    padded = torch.nn.functional.pad(values.double(), (0, nk * sk - lk, 0, nq * sq - lq), value=float("nan"))
    parts = padded.unflatten(-1, (nk, sk)).unflatten(2, (nq, sq)).transpose(3, 4).flatten(-2)  # (B, H, nq, nk, sq*sk)
    real = ~parts.isnan()
    low = torch.where(real, parts, float("inf")).amin(-1)
    high = torch.where(real, parts, float("-inf")).amax(-1)
    assert bool((lo.double() <= low).all()) and bool((high <= hi.double()).all())


@given(predicates(), st.integers(1, 200), st.integers(1, 200), st.sampled_from([(32, 16), (128, 64), (64, 32)]))
def test_random_predicates_on_the_native_engine_equal_pair_by_pair(tree, lq, lk, blocks):
    """Every evaluation of the predicate on the engine (attnkit/masks/_program.py), however small: the
    block map and every bit of the prepared mask equal torch's per-pair answer; a predicate outside
    the program language (a float division) or a pair the engine cannot compute takes torch's path."""
    from _oracle import engine_evaluations  # tests/_oracle.py

    from attnkit.kernels.native import build

    if not build.available():
        pytest.skip("the native engine does not run here")
    fn = predicate(tree)
    note(repr(tree))
    allowed = flex_module.create_mask(fn, B, H, lq, lk, device="cpu")
    with engine_evaluations() as answered:
        mask = masks.from_fn(fn, batch_size=B, num_heads=H)
        bq, bk = blocks
        assert torch.equal(mask.block_map(lq, lk, bq, bk).expand(B, H, -1, -1), codes_of_pairs(allowed, bq, bk))
        prepared = attnkit.prepare(masks.from_fn(fn, batch_size=B, num_heads=H), lq, lk, block_size=blocks)
    assert torch.equal(prepared.materialize().expand_as(allowed), allowed)
    event(
        "the engine answered"
        if answered and all(answered)
        else "torch's path (in part)"
        if answered
        else "no pair left to evaluate, or not a program"
    )
