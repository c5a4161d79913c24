"""Properties over random shapes, masks and dtypes (hypothesis)."""

import torch
from _oracle import assert_oracle, gold_and_naive
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit.kernels import reference

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def problems(draw, dtypes=(torch.float64, torch.float32, torch.bfloat16, torch.float16)):
    b = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 3))
    lq, lk = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    d, dv = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, lk, dv, generator=g, dtype=torch.float64).to(dtype)
    mask_shape = draw(st.sampled_from([None, (lq, lk), (b, 1, 1, lk), (b, hq, lq, lk)]))
    mask = None if mask_shape is None else torch.rand(mask_shape, generator=g) > draw(st.floats(0.0, 0.9))
    return q, k, v, mask


@SETTINGS
@given(problems(), st.sampled_from(["auto", "sdpa", "reference"]))
def test_every_kernel_equals_the_reference(problem, kernel):
    q, k, v, mask = problem
    gold, naive = gold_and_naive(q, k, v, mask)
    # at most 12 x 12 scores: the naive error can be a lucky rounding far below its usual size (one
    # query over 3 keys: 1e-9 against SDPA's 5e-8, half a rounding), so it is floored (docs/testing.md)
    assert_oracle(attnkit.attention(q, k, v, mask, kernel=kernel), gold, naive, small=True)


@SETTINGS
@given(problems(dtypes=(torch.float64,)), st.data())
def test_permuting_keys_and_values_together_changes_nothing(problem, data):
    q, k, v, mask = problem
    if mask is not None:
        mask = mask.expand(*q.shape[:-1], k.shape[-2])
    perm = torch.tensor(data.draw(st.permutations(range(k.shape[-2]))), dtype=torch.long)
    out = attnkit.attention(q, k, v, mask)
    permuted_mask = None if mask is None else mask[..., perm]
    again = attnkit.attention(q, k[..., perm, :], v[..., perm, :], permuted_mask)
    assert torch.allclose(out, again, atol=1e-12)


@SETTINGS
@given(problems(dtypes=(torch.float64,)), st.data())
def test_split_keys_merge_by_log_sum_exp(problem, data):
    q, k, v, mask = problem
    lk = k.shape[-2]
    mask = torch.ones(lk, dtype=torch.bool) if mask is None else mask
    mask = mask.expand(*q.shape[:-1], lk)
    cut = data.draw(st.integers(0, lk))
    scale = q.shape[-1] ** -0.5
    parts = []
    for keys in (slice(0, cut), slice(cut, lk)):
        m = mask[..., keys]
        out = attnkit.attention(q, k[..., keys, :], v[..., keys, :], m)
        lse = reference.log_sum_exp(q, k[..., keys, :], m, scale=scale)
        parts.append((out, lse))
    (o1, l1), (o2, l2) = parts
    total = torch.logaddexp(l1, l2)
    safe = torch.where(total == float("-inf"), 0.0, total)
    merged = torch.exp(l1 - safe)[..., None] * o1 + torch.exp(l2 - safe)[..., None] * o2
    assert torch.allclose(merged, attnkit.attention(q, k, v, mask), atol=1e-12)
