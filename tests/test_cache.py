"""Every cache of attnkit._cache serves only what its key proves: staleness tests for each one.

Each test changes what a cached result was made from in every way a user can (in place, through
``.data``, through ``tensor.numpy()``, a rebound closure cell, a new object at a reused id) and
checks the next call against the formula. Where a cache keyed by identity or version counter was
stale (a from_fn predicate keyed by the function object; SDPA's zeroed K/V copies reused while
the same tensors came back with their version unchanged), the test is its regression test.
"""

from __future__ import annotations

import collections
import gc
import types

import numpy as np
import pytest
import torch
from _oracle import naive_attention, randn

import attnkit
from attnkit import _cache, masks
from attnkit.kernels import fastpath
from attnkit.kernels.native import build as native_build
from attnkit.plan import PREPARATIONS


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
    state = collections.deque([8])  # state a key cannot read (a C type with no attributes)
    mask = masks.from_fn(lambda b, h, i, j: (j <= i) & (i - j < state[0]))
    assert mask.value_key() is None and not mask.cacheable()
    q, k, v = (randn(1, 2, 300, 16) for _ in range(3))
    attnkit.attention(q, k, v, mask, kernel="tiled")
    state[0] = 50
    _close(attnkit.attention(q, k, v, mask, kernel="tiled"), _want(q, k, v, mask, 300, 300))


def test_a_predicate_over_a_user_object_is_keyed_by_its_attributes():
    """An instance of the user's class is keyed by its class and its attributes (it had no key before,
    so its mask was prepared on every call): kept while they stay, prepared again when one changes."""

    class Window:
        def __init__(self):
            self.width = 8

    state = Window()
    mask = masks.from_fn(lambda b, h, i, j: (j <= i) & (i - j < state.width))
    assert mask.value_key() is not None
    q, k, v = (randn(1, 2, 300, 16) for _ in range(3))
    start = PREPARATIONS["count"]
    attnkit.attention(q, k, v, mask, kernel="tiled")
    attnkit.attention(q, k, v, mask, kernel="tiled")
    assert PREPARATIONS["count"] - start == 1
    state.width = 50
    _close(attnkit.attention(q, k, v, mask, kernel="tiled"), _want(q, k, v, mask, 300, 300))
    assert PREPARATIONS["count"] - start == 2


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
    native = native_build.available()  # loaded before the count starts (loading changes the registry's state)
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
        chosen = attnkit.explain(q, k, v, masks.padding(torch.tensor([3, 4, 5]))).kernel
        assert chosen == ("native" if native else "sdpa")
        assert len(fastpath.LEAN_LIMITS) == 1  # the row path's runner, or SDPA's over each sequence's keys
        with pytest.raises(ValueError, match="Lk=40"):
            attnkit.attention(q, k, v, masks.padding(torch.tensor([41, 1, 1])))
        with pytest.raises(ValueError, match="Lk=40"):  # past Lk everywhere: not "every key", an error
            attnkit.attention(q, k, v, masks.padding(torch.tensor([41, 41, 41])))
        # a longer cache (a growing one) is served by the same entry: the key length is read per call
        k2, v2 = randn(3, 2, 50, 16), randn(3, 2, 50, 16)
        mask = masks.padding(torch.tensor([50, 9, 20]))
        _close(attnkit.attention(q, k2, v2, mask), _want(q, k2, v2, mask, 1, 50))
        assert len(fastpath.LEAN_LIMITS) == 1


# --- state a predicate reaches: followed by value, or never cached ----------------------------------

#: A configuration "module" and class the predicates below read (as a user's config.py would be).
CONFIG = types.ModuleType("attnkit_test_config")
CONFIG.WIDTH = 8


class Config:
    WIDTH = 8


#: A module whose name only starts like a library's (a user's torch_utils.py).
TORCH_UTILS = types.ModuleType("torch_utils")
exec("WIDTH = 8\ndef near(q, kv):\n    return (q - kv).abs() < WIDTH\n", TORCH_UTILS.__dict__)

WIDTH = 8  # read only inside nested code of the predicates below


def _module_attribute(b, h, q, kv):
    return (kv <= q) & (q - kv < CONFIG.WIDTH)


def _class_attribute(b, h, q, kv):
    return (kv <= q) & (q - kv < Config.WIDTH)


def _nested_lambda(b, h, q, kv):
    near = lambda x: x < WIDTH  # noqa: E731
    return (kv <= q) & near(q - kv)


def _inner_def(b, h, q, kv):
    def near(x):
        return x < WIDTH

    return (kv <= q) & near(q - kv)


def _comprehension(b, h, q, kv):
    return (kv <= q) & [x < WIDTH for x in [q - kv]][0]


def _library_lookalike(b, h, q, kv):
    return (kv <= q) & TORCH_UTILS.near(q, kv)


def _set_module(n):
    CONFIG.WIDTH = n


def _set_class(n):
    Config.WIDTH = n


def _set_global(n):
    globals()["WIDTH"] = n


def _set_lookalike(n):
    TORCH_UTILS.WIDTH = n


READS = {
    "a config module's attribute": (_module_attribute, _set_module),
    "a class attribute": (_class_attribute, _set_class),
    "a global inside a nested lambda": (_nested_lambda, _set_global),
    "a global inside an inner def": (_inner_def, _set_global),
    "a global inside a comprehension": (_comprehension, _set_global),
    "a module named like torch_utils": (_library_lookalike, _set_lookalike),
}


@pytest.mark.parametrize("kernel", ["auto", "tiled", "sdpa"])
@pytest.mark.parametrize("name", list(READS))
def test_state_a_predicate_reads_through_modules_classes_and_nested_code_is_followed(name, kernel):
    """The fingerprint of a from_fn predicate follows what it reads by value: a config module's or
    class's attribute (keyed by the module or class object, the first mask was kept), a global read
    only inside a nested lambda, inner def or comprehension (not among the outer code's names), a
    function of a user module named like a library (``torch_utils``: keyed by identity)."""
    fn, change = READS[name]
    change(8)
    try:
        mask = masks.from_fn(fn)
        q, k, v = (randn(1, 2, 300, 16) for _ in range(3))
        first = attnkit.attention(q, k, v, mask, kernel=kernel)
        _close(first, _want(q, k, v, mask, 300, 300))
        change(60)
        second = attnkit.attention(q, k, v, mask, kernel=kernel)
        _close(second, _want(q, k, v, mask, 300, 300))
        assert not torch.allclose(first, second)
    finally:
        change(8)


def _callables():
    """Callables a predicate may close over whose state changes behind their identity: ``(callable,
    how to change it)`` by name."""
    ids = torch.arange(300) // 50

    emb = torch.nn.Embedding(300, 1)
    with torch.no_grad():
        emb.weight.copy_((torch.arange(300) // 50).float()[:, None])
    holder = torch.nn.Module()
    holder.register_buffer("ids", (torch.arange(300) // 50).clone())

    def bump_emb():
        with torch.no_grad():
            emb.weight.copy_((torch.arange(300) // 25).float()[:, None])

    return {
        "a bound tensor method": (
            lambda q, kv, pick=ids.index_select: (
                pick(0, q.reshape(-1)).view(q.shape) == pick(0, kv.reshape(-1)).view(kv.shape)
            ),
            lambda: ids.copy_(torch.arange(300) // 25),
        ),
        "an nn.Embedding lookup": (
            lambda q, kv: emb(q.reshape(-1)).view(q.shape) == emb(kv.reshape(-1)).view(kv.shape),
            bump_emb,
        ),
        "an nn.Module holding a buffer": (
            lambda q, kv: holder.ids[q] == holder.ids[kv],
            lambda: holder.ids.copy_(torch.arange(300) // 25),
        ),
    }


@pytest.mark.parametrize("name", list(_callables()))
def test_callables_with_state_behind_their_identity_are_not_served_stale(name):
    """Bound tensor methods and torch.nn modules were keyed by identity (their tensor never read): now a
    bound method is keyed by its tensor's bytes, and a module has no fingerprint, so its mask is
    prepared again on each call."""
    same_doc, change = _callables()[name]
    mask = masks.from_fn(lambda b, h, q, kv, f=same_doc: f(q, kv) & (kv <= q))
    q, k, v = (randn(1, 2, 300, 16) for _ in range(3))
    first = attnkit.attention(q, k, v, mask)
    _close(first, _want(q, k, v, mask, 300, 300))
    change()
    second = attnkit.attention(q, k, v, mask)
    _close(second, _want(q, k, v, mask, 300, 300))
    assert not torch.allclose(first, second)


def test_a_predicate_through_numpy_is_refused_with_what_to_write_instead():
    """A predicate that leaves torch (np.vectorize over .numpy()) cannot run one pair at a time under
    torch.vmap, and broadcasting it is not proved elementwise: a clear error, not an answer that may
    hold only for the tiles it was evaluated on (it was evaluated by broadcasting before)."""
    table = (torch.arange(300) // 50).numpy().copy()
    lookup = np.vectorize(lambda i: table[i])
    mask = masks.from_fn(
        lambda b, h, q, kv: (torch.from_numpy(lookup(q.numpy())) == torch.from_numpy(lookup(kv.numpy()))) & (kv <= q)
    )
    assert mask.value_key() is None  # a vectorized function has no fingerprint either
    q = randn(1, 2, 300, 16)
    with pytest.raises(ValueError, match=r"one pair at a time under torch.vmap .*numpy.*no host reads"):
        attnkit.attention(q, q, q, mask)


def test_zero_and_negative_zero_are_different_keys():
    """A float a predicate reads is keyed by its bits: 0.0 and -0.0 (equal, so one key before) differ."""

    def make(c):
        return masks.from_fn(lambda b, h, q, kv: (kv <= q) | (torch.copysign(torch.tensor(1.0), torch.tensor(c)) > 0))

    q, k, v = (randn(1, 2, 300, 16) for _ in range(3))
    everything, causal = make(0.0), make(-0.0)
    _close(attnkit.attention(q, k, v, everything), _want(q, k, v, everything, 300, 300))
    _close(attnkit.attention(q, k, v, causal), _want(q, k, v, causal, 300, 300))
    assert everything.value_key() != causal.value_key()


@pytest.mark.parametrize("kernel", ["native", "fused", "math", "sdpa", "reference"])
def test_a_prepared_mask_is_the_one_truth_of_its_predicate_for_every_kernel(kernel):
    """A PreparedMask keeps the pairs its predicate gave when it was prepared: a change to what the
    predicate reads afterwards changes no kernel's answer (native read the bits, sdpa and reference
    evaluated the predicate again, fused and math mixed the two)."""
    if kernel == "native" and not native_build.available():
        pytest.skip(native_build.status()[1])
    state = {"width": 8}
    mask = masks.from_fn(lambda b, h, q, kv: (kv <= q) & (q - kv < state["width"]))
    prepared = attnkit.prepare(mask, 300, 300)
    before = mask.materialize(300, 300)
    state["width"] = 80
    q, k, v = (randn(1, 2, 300, 16) for _ in range(3))
    got = attnkit.attention(q, k, v, prepared, kernel=kernel)
    want = naive_attention(q.double(), k.double(), v.double(), before)[0]
    _close(got, want)
    assert torch.equal(prepared.materialize(), before)


@pytest.mark.parametrize("how", ["data", "numpy", "in place"])
def test_a_kv_cache_rolled_back_through_data_or_numpy_appends_after_the_new_end(how):
    """KVCache's common-fill shortcut is keyed by the lengths' values: a roll-back written through
    ``.data`` or ``.numpy()`` keeps the tensor's version counter, and the shortcut appended after the
    old end (attention then read the rolled-back entry)."""
    mha = attnkit.MultiHeadAttention(32, 4)
    cache = attnkit.KVCache(2, 4, 16, 8)
    x = randn(2, 6, 32)
    with torch.no_grad():
        mha(x[:, :5], mask=masks.causal(), cache=cache)
        roll = {"data": lambda: cache.lengths.data.sub_(2), "numpy": lambda: cache.lengths.numpy().__isub__(2)}
        roll.get(how, lambda: cache.lengths.sub_(2))()
        assert cache.lengths.tolist() == [3, 3]
        step, _ = mha(x[:, 5:6], mask=masks.causal(), cache=cache)
        # the step's token sits right after the 3 kept ones: the same as running those 4 tokens fresh
        fresh, _ = mha(torch.cat([x[:, :3], x[:, 5:6]], dim=1), mask=masks.causal())
    torch.testing.assert_close(step[:, 0], fresh[:, -1], atol=1e-5, rtol=1e-5)
    assert cache.lengths.tolist() == [4, 4]


def test_switching_kernels_after_a_padding_decode_step_runs_the_kernel_explain_names(monkeypatch):
    """After a decoding step with a padding mask ran the native row path (a runner that takes the
    lengths), turning the engine off in the process, or pinning another kernel the public way, runs
    the kernel explain names: each kernel's state and use_kernels are in every cache key (with the
    switch flipped, the row path kept running while explain named sdpa)."""
    if not native_build.available():
        pytest.skip(native_build.status()[1])
    from _oracle import OpCounter

    q, k, v = randn(2, 4, 1, 16), randn(2, 2, 64, 16), randn(2, 2, 64, 16)
    with torch.no_grad():
        for n in (40, 41):
            attnkit.attention(q, k, v, masks.padding(torch.tensor([n, 30])))
        mask = masks.padding(torch.tensor([42, 31]))
        monkeypatch.setattr(native_build, "ENABLED", False)  # the staleness case itself
        assert attnkit.explain(q, k, v, mask).kernel == "sdpa"
        with OpCounter("attnkit::native_forward") as ops:
            got = attnkit.attention(q, k, v, mask)
        assert ops.counts["attnkit::native_forward"] == 0
        monkeypatch.undo()
        with attnkit.use_kernels("sdpa"):
            assert attnkit.explain(q, k, v, mask).kernel == "sdpa"
            with OpCounter("attnkit::native_forward") as ops:
                pinned = attnkit.attention(q, k, v, mask)
    assert ops.counts["attnkit::native_forward"] == 0
    _close(got, _want(q, k, v, mask, 1, 64))
    _close(pinned, _want(q, k, v, mask, 1, 64))
