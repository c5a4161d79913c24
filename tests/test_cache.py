"""Every cache of attnkit._cache serves only what its key proves: staleness tests for each one.

Each test changes what a cached result was made from in every way a user can (in place, through
``.data``, through ``tensor.numpy()``, a rebound closure cell, a new object at a reused id) and
checks the next call against the formula. Where a cache keyed by identity or version counter was
stale (a from_fn predicate keyed by the function object; SDPA's zeroed K/V copies reused while
the same tensors came back with their version unchanged), the test is its regression test.
"""

from __future__ import annotations

import gc

import pytest
import torch
from _oracle import naive_attention, randn

import attnkit
from attnkit import _cache, masks
from attnkit.kernels import fastpath
from attnkit.kernels.native import build as native_build


def _want(q, k, v, mask, lq, lk):
    return naive_attention(q.double(), k.double(), v.double(), attnkit.prepare(mask, lq, lk).materialize())[0]


def _close(got, want):
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_the_implicit_cache_of_prepared_masks_is_bounded():
    _cache.PREPARED.clear()
    q = randn(1, 1, 300, 8)
    for i in range(_cache.PREPARED.size + 5):
        attnkit.attention(q, q, q, masks.sliding_window(i + 1))
    assert len(_cache.PREPARED) == _cache.PREPARED.size


EDITS = {
    "in place": lambda t, value: t.fill_(value),
    ".data": lambda t, value: t.data.fill_(value),
    "numpy": lambda t, value: t.numpy().fill(value),
}


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("kernel", ["auto", "tiled", "sdpa"])
def test_a_from_fn_predicate_whose_captured_tensor_changes_is_not_served_stale(edit, kernel):
    """masks.from_fn is keyed by the predicate's code and the contents of what it closes over: the
    same closure after its captured tensor changed is another mask (keyed by the function object,
    it kept its first prepared plan, and the lean path its first runner)."""
    width = torch.tensor(8)

    def window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < width)

    mask = masks.from_fn(window)
    q, k, v = (randn(1, 2, 300, 16) for _ in range(3))
    first = attnkit.attention(q, k, v, mask, kernel=kernel)
    _close(first, _want(q, k, v, mask, 300, 300))
    EDITS[edit](width, 40)
    second = attnkit.attention(q, k, v, mask, kernel=kernel)
    _close(second, _want(q, k, v, mask, 300, 300))
    assert not torch.allclose(first, second)


def test_a_rebound_closure_cell_is_another_predicate():
    width = 8

    def window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < width)

    mask = masks.from_fn(window)
    q, k, v = (randn(1, 2, 300, 16) for _ in range(3))
    first = attnkit.attention(q, k, v, mask)
    width = 100  # noqa: F841  (read by the closure)
    _close(attnkit.attention(q, k, v, mask), _want(q, k, v, mask, 300, 300))
    assert not torch.allclose(first, attnkit.attention(q, k, v, mask))


def test_equal_closures_share_one_preparation():
    """Two closures of one code over equal contents are one value: prepared once."""
    from attnkit.plan import PREPARATIONS

    def make(n):
        limit = torch.tensor(n)
        return masks.from_fn(lambda b, h, i, j: (j <= i) & (i - j < limit))

    q = randn(1, 2, 300, 16)
    start = PREPARATIONS["count"]
    attnkit.attention(q, q, q, make(30), kernel="tiled")
    attnkit.attention(q, q, q, make(30), kernel="tiled")
    assert PREPARATIONS["count"] - start == 1
    attnkit.attention(q, q, q, make(31), kernel="tiled")
    assert PREPARATIONS["count"] - start == 2


def test_a_predicate_over_an_object_that_cannot_be_fingerprinted_is_never_kept():
    class Window:
        width = 8

    state = Window()
    mask = masks.from_fn(lambda b, h, i, j: (j <= i) & (i - j < state.width))
    assert mask.value_key() is None and not mask.cacheable()
    q, k, v = (randn(1, 2, 300, 16) for _ in range(3))
    attnkit.attention(q, k, v, mask, kernel="tiled")
    state.width = 50
    _close(attnkit.attention(q, k, v, mask, kernel="tiled"), _want(q, k, v, mask, 300, 300))


@pytest.mark.parametrize("edit", list(EDITS))
def test_keys_zeroed_for_a_dense_mask_are_never_reused_stale(edit):
    """SDPA's dense-mask path zeroes the keys no query uses on every call: a K/V edited between two
    calls of one signature (a decoder's cross-attention over a memory) gives the new answer (the
    zeroed copies were reused while identity and version matched, which .data and numpy writes
    keep)."""
    mask = masks.padding(torch.tensor([5, 3])) & masks.from_fn(lambda b, h, i, j: j != 1)
    q = randn(2, 2, 1, 8)
    k, v = randn(2, 2, 6, 8), randn(2, 2, 6, 8)
    with torch.no_grad():
        first = attnkit.attention(q, k, v, mask)
        assert attnkit.explain(q, k, v, mask).kernel == "sdpa"
        EDITS[edit](k, 0.5)
        EDITS[edit](v, 2.0)
        second = attnkit.attention(q, k, v, mask)
    _close(second, _want(q, k, v, mask, 1, 6))
    assert not torch.allclose(first, second)


def test_a_mask_copies_what_it_is_built_from_so_its_cached_plan_stays_right():
    lengths = torch.tensor([100, 250])
    mask = masks.padding(lengths)
    q, k, v = (randn(2, 2, 300, 16) for _ in range(3))
    first = attnkit.attention(q, k, v, mask, kernel="tiled")
    for edit in EDITS.values():
        edit(lengths, 7)
        assert torch.equal(attnkit.attention(q, k, v, mask, kernel="tiled"), first)


def test_a_new_mask_at_a_reused_id_finds_nothing_of_the_old_one():
    """Masks without a value key (dense ones) are kept by identity, held weakly: a new mask at the
    id of a dead one is prepared for itself."""
    q, k, v = (randn(1, 2, 400, 16) for _ in range(3))
    old = masks.as_mask(torch.rand(400, 400) > 0.5)
    assert old.value_key() is None
    attnkit.attention(q, k, v, old, kernel="tiled")
    old_id = id(old)
    del old
    gc.collect()
    for _ in range(200):  # CPython reuses the freed slot soon
        new = masks.as_mask(torch.rand(400, 400) > 0.5)
        if id(new) == old_id:
            break
    _close(attnkit.attention(q, k, v, new, kernel="tiled"), _want(q, k, v, new, 400, 400))


def test_a_prepared_masks_store_dies_with_it():
    """What kernels derive from a PreparedMask lives in its store, held weakly: a new prepared mask
    (at a reused id or not) starts with an empty store."""
    q, k, v = (randn(1, 2, 300, 16) for _ in range(3))
    mask = masks.from_fn(lambda b, h, i, j: (i - j) % 3 == 0)
    prepared = attnkit.prepare(mask, 300, 300)
    attnkit.attention(q, k, v, prepared, kernel="fused")
    assert _cache.plan_store(prepared).values()  # evaluated tiles
    del prepared
    gc.collect()
    again = attnkit.prepare(masks.from_fn(lambda b, h, i, j: (i - j) % 5 == 0), 300, 300)
    assert _cache.plan_store(again).values() == []  # at the old id or not
    _close(attnkit.attention(q, k, v, again, kernel="fused"), _want(q, k, v, again.mask, 300, 300))


def test_decoding_steps_with_a_new_padding_mask_each_share_one_runner_and_stay_exact():
    """A decoding step builds a new masks.padding(lengths) each step: its calls are kept without
    the lengths (LEAN_LIMITS), one runner takes them per call. Every step equals the formula,
    whatever its lengths (equal, different, 0, Lk); lengths past Lk raise as on a first call;
    NaN past each length never reaches the output."""
    _cache.clear()
    q, k, v = randn(3, 4, 1, 16), randn(3, 2, 40, 16), randn(3, 2, 40, 16)
    steps = ([40, 7, 0], [39, 7, 1], [5, 5, 5], [40, 40, 40], [1, 2, 3], [0, 0, 0])
    with torch.no_grad():
        for lengths in steps:
            mask = masks.padding(torch.tensor(lengths))
            poisoned_k, poisoned_v = k.clone(), v.clone()
            for b, n in enumerate(lengths):
                poisoned_k[b, :, n:], poisoned_v[b, :, n:] = float("nan"), float("inf")
            got = attnkit.attention(q, poisoned_k, poisoned_v, mask)
            _close(got, _want(q, k, v, mask, 1, 40))
        native = native_build.available()
        chosen = attnkit.explain(q, k, v, masks.padding(torch.tensor([3, 4, 5]))).kernel
        assert chosen == ("native" if native else "sdpa")
        assert len(fastpath.LEAN_LIMITS) == (1 if native else 0)
        with pytest.raises(ValueError, match="Lk=40"):
            attnkit.attention(q, k, v, masks.padding(torch.tensor([41, 1, 1])))
        # another signature (a longer cache) is another entry, exact too
        k2, v2 = randn(3, 2, 50, 16), randn(3, 2, 50, 16)
        mask = masks.padding(torch.tensor([50, 9, 20]))
        _close(attnkit.attention(q, k2, v2, mask), _want(q, k2, v2, mask, 1, 50))
        assert len(fastpath.LEAN_LIMITS) == (2 if native else 0)
