"""The invariant the fast path (attnkit.kernels.fastpath) relies on, checked on the registry itself.

Two of its caches leave a part of the call out of their key: LEAN_ANY_LENGTH the key length of an
unmasked rank-4 call SDPA runs, LEAN_LIMITS the lengths of a padding mask the native engine's row
path or SDPA runs. That is right only while the registry's choice for such calls does not depend on what
is left out; these tests ask the registry (``explain``) across the values left out.
"""

from __future__ import annotations

import collections
import itertools
import types

import pytest
import torch
from _oracle import randn

import attnkit
from attnkit import masks
from attnkit.kernels import fastpath
from attnkit.kernels.native import build as native_build
from attnkit.kernels.native import kernel as native

KEY_LENGTHS = (1, 2, 7, 64, 127, 300, 2049, 5000)


@pytest.mark.parametrize(
    "b, hq, hkv, lq, dtype, grad",
    [
        (1, 8, 8, 1, torch.float32, False),
        (4, 8, 2, 1, torch.float32, False),
        (4, 8, 2, 1, torch.bfloat16, False),
        (4, 8, 4, 1, torch.float16, False),
        (2, 4, 4, 3, torch.bfloat16, False),
        (1, 2, 1, 15, torch.float32, True),
        (1, 32, 8, 64, torch.float32, False),
        (2, 16, 16, 128, torch.bfloat16, True),
        (1, 4, 4, 9, torch.float64, False),
    ],
)
def test_an_unmasked_calls_choice_does_not_depend_on_its_key_length(b, hq, hkv, lq, dtype, grad):
    """Where SDPA or the native row path takes an unmasked rank-4 call at one key length, it takes it
    at every one: the choice LEAN_ANY_LENGTH keeps without Lk is the registry's for any Lk."""
    assert fastpath.builtin_registry()
    chosen = set()
    for lk in KEY_LENGTHS:
        q = torch.empty(b, hq, lq, 16, dtype=dtype).requires_grad_(grad)
        k = torch.empty(b, hkv, lk, 16, dtype=dtype)
        plan = attnkit.explain(q, k, k)
        chosen.add((plan.kernel, "row path" in str(plan)))
    kept_any_length = {c for c in chosen if c[0] == "sdpa" or c[1]}
    assert len(chosen) == 1 or not kept_any_length, chosen


def test_a_grouped_decoding_step_over_a_growing_cache_takes_the_row_path_and_the_formula():
    """One float32 query per K/V group over every key (a decoding step of a GQA model with no padding)
    runs on the native row path at every cache length, through the fast path's any-length runner,
    and equals the float64 formula (TESTING.md's rule)."""
    if not native_build.available():
        pytest.skip(native_build.status()[1])
    from _oracle import assert_oracle, gold_and_naive

    q, keys, values = randn(3, 8, 1, 64), randn(3, 2, 700, 64), randn(3, 2, 700, 64)
    for lk in (1, 2, 64, 65, 300, 700, 513):
        k, v = keys[:, :, :lk], values[:, :, :lk]
        assert "row path" in str(attnkit.explain(q, k, v)), attnkit.explain(q, k, v)
        with torch.no_grad():
            out = attnkit.attention(q, k, v)
        ke, ve = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
        assert_oracle(out, *gold_and_naive(q, ke, ve), what=f"Lk={lk}")
    assert "row path" in str(attnkit.explain(q, keys, values, masks.causal()))  # a causal mask hides nothing here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_padding_masks_choice_does_not_depend_on_its_lengths(dtype):
    """Where the native engine's row path (float32 and half precision) or SDPA (without the engine)
    takes a decoding step with a padding mask, it takes it for any lengths (equal, different, 0,
    Lk): the runner LEAN_LIMITS keeps without them is the registry's choice for all of them."""
    assert fastpath.builtin_registry()
    engine = native_build.available()
    expected = "native" if engine else "sdpa"
    shapes = itertools.product(
        (1, 2, native.few_rows() if engine else 8), ((1, 4, 4), (3, 8, 2), (2, 2, 1)), (8, 96, 1000)
    )
    for lq, (b, hq, hkv), lk in shapes:  # LEAN_LIMITS leaves Lk out too (a growing cache)
        q, k = torch.empty(b, hq, lq, 16, dtype=dtype), torch.empty(b, hkv, lk, 16, dtype=dtype)
        draws = [[0] * b, [1] * b, list(range(1, b + 1)), [lk // 2] * b, [lk - 1 - i for i in range(b)]]
        chosen = {attnkit.explain(q, k, k, masks.padding(torch.tensor(n))).kernel for n in draws}
        assert chosen == {expected}, (lq, b, hq, hkv, lk, chosen)
        # every key of every sequence: the fast path serves it as no mask, and the registry agrees
        assert attnkit.explain(q, k, k, masks.padding(torch.tensor([lk] * b))).kernel == attnkit.explain(q, k, k).kernel


def test_decoding_over_a_growing_kv_cache_validates_once(monkeypatch):
    """A MultiHeadAttention decoding one token a step into a KVCache with a causal mask: the step's
    mask is the cache's lengths alone, so after the first step the fast path serves every later one
    (no call validated or chosen again, nothing prepared) while the cache grows; the answers are the
    float64 formula's."""
    if not native_build.available():
        pytest.skip(native_build.status()[1])
    from _oracle import assert_oracle, gold_and_naive

    from attnkit.kernels import fastpath as lean

    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4).eval()
    cache = attnkit.KVCache(batch_size=3, num_kv_heads=4, max_len=64, head_dim=8)
    made = []
    real = lean.make_call
    monkeypatch.setattr(lean, "make_call", lambda *a, **kw: made.append(1) or real(*a, **kw))
    seen = []
    hook = mha.register_attention_hook(lambda module, q, k, v, mask: seen.append((q, k, v, mask)))
    with torch.no_grad():
        mha(randn(3, 20, 32), mask=masks.causal(), cache=cache)  # the prompt
        for step in range(10):
            mha(randn(3, 1, 32), mask=masks.causal(), cache=cache)
            if step == 0:
                made.clear()  # the first decoding step validates and chooses
    hook.remove()
    assert not made, f"{len(made)} decoding steps were validated again"
    for q, k, v, mask in seen[2:]:
        lk = k.shape[2]
        assert mask.limit_only() and mask.key_limit_values() == (lk,) * 3  # every stored entry, nothing else
        out = attnkit.attention(q, k, v, mask)
        assert_oracle(out, *gold_and_naive(q, k, v), what=f"Lk={lk}")


def test_the_fast_path_serves_what_the_full_path_computes():
    """The lean runners (any length, any padding lengths) give what validating and choosing again
    gives, for every length and lengths drawn after the first call."""
    with torch.no_grad():
        q, keys = randn(2, 4, 1, 16), randn(2, 2, 200, 16)
        for lk in (1, 10, 11, 150, 199, 1):  # one key first: its exact path must not serve the others
            k = keys[:, :, :lk]
            torch.testing.assert_close(attnkit.attention(q, k, k), attnkit.attention(q, k, k, kernel="reference"))
        for lengths in ([5, 9], [200, 1], [0, 0], [200, 200], [33, 33]):
            mask = masks.padding(torch.tensor(lengths))
            torch.testing.assert_close(
                attnkit.attention(q, keys, keys, mask), attnkit.attention(q, keys, keys, mask, kernel="reference")
            )


def test_the_fast_path_key_changes_with_everything_the_choice_reads():
    """use_kernels, a registration and a kernel's own state are in the key: the same call is another
    signature under each (its runner is never served across them)."""
    q = randn(1, 2, 4, 8)
    base = fastpath.signature(q, q, q, masks.causal(), None)
    with attnkit.use_kernels("reference"):
        assert fastpath.signature(q, q, q, masks.causal(), None) != base
    assert fastpath.signature(q, q, q, masks.causal(), 0.0) != fastpath.signature(q, q, q, masks.causal(), -0.0)
    keyed = masks.from_fn(lambda b, h, i, j: i >= j + torch.tensor(0))  # torch.tensor: keyed by identity
    assert fastpath.signature(q, q, q, keyed, None) is not None
    state = types.SimpleNamespace(shift=1)
    by_attributes = masks.from_fn(lambda b, h, i, j: i >= j + state.shift)  # an object: keyed by its attributes
    assert fastpath.signature(q, q, q, by_attributes, None) is not None
    held = collections.deque([1])
    unkeyed = masks.from_fn(lambda b, h, i, j: i >= j + held[0])  # state no key can read: no value key
    assert fastpath.signature(q, q, q, unkeyed, None) is None
