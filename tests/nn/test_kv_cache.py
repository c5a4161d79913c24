"""KVCache: appends with counts, capacity, dtype, masks and biases aligned per sequence; decoding
equals recomputing the prefix."""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch
from _oracle import BIASES, Ops, mixed_fill_decode, randn

import attnkit
from attnkit import bias, masks
from attnkit.nn import KVCache


@pytest.mark.parametrize(
    "counts,exc,match",
    [
        ([1.5, 2.9], TypeError, "counts must hold integers"),
        (torch.tensor([True, False]), TypeError, "counts must hold integers"),
        ([1, 2, 3], ValueError, r"counts must have shape \(2,\)"),
        ([1, 4], ValueError, r"counts must lie in 0..3"),
        ("12", TypeError, "counts must be a sequence"),
    ],
)
def test_kv_cache_counts_are_checked(counts, exc, match):
    cache = attnkit.KVCache(2, 2, 8, 4)
    with pytest.raises(exc, match=match):
        cache.append(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4), counts)


def test_kv_cache_dtype_and_rank_errors():
    cache = attnkit.KVCache(2, 2, 8, 4)
    with pytest.raises(TypeError, match=r"Build the cache with KVCache\(..., dtype=torch.float64\)"):
        cache.append(torch.randn(2, 2, 3, 4, dtype=torch.float64), torch.randn(2, 2, 3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="must have 4 dimensions"):
        cache.append(torch.randn(2, 3, 4), torch.randn(2, 3, 4))


def test_kv_cache_padded_appends_and_capacity():
    cache = attnkit.KVCache(2, 1, 4, 2)
    k = torch.randn(2, 1, 3, 2)
    cache.append(k, k, torch.tensor([3, 1]))
    assert cache.lengths.tolist() == [3, 1]
    assert torch.equal(cache.keys[1, :, :1], k[1, :, :1]) and (cache.keys[1, :, 1:] == 0).all()
    cache.append(torch.randn(2, 1, 1, 2), torch.randn(2, 1, 1, 2))
    with pytest.raises(ValueError, match="sequence 0 holds 4 entries and 1 more do not fit in max_len=4"):
        cache.append(torch.randn(2, 1, 1, 2), torch.randn(2, 1, 1, 2))


def test_kv_cache_append_makes_no_host_sync_while_it_has_room():
    cache = attnkit.KVCache(2, 2, 64, 8)
    with Ops() as ops:
        for _ in range(5):
            cache.append(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
            cache.stored()
            cache.mask(masks.causal())
    assert not any("_local_scalar_dense" in name for name in ops.names)
    assert cache.lengths.tolist() == [5, 5]


# regression: a finding of the adversarial review of the inputs (hardening)
def test_kv_cache_counts_may_be_a_list():
    cache = KVCache(2, 2, 16, 8)
    cache.append(randn(2, 2, 3, 8), randn(2, 2, 3, 8), counts=[1, 2])
    assert cache.lengths.tolist() == [1, 2]


# regression: finding F3 of the review of the seams between features
@pytest.mark.parametrize("name", list(BIASES))
def test_cached_decoding_with_a_bias_equals_recomputing(name):
    mha = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    worst, _ = mixed_fill_decode(mha, masks.causal(), BIASES[name](4))
    assert worst < 1e-5


# regression: finding F3 of the review of the seams between features
@pytest.mark.parametrize("mask", ["from_fn", "causal&from_fn"])
def test_cached_decoding_with_a_from_fn_mask_equals_recomputing(mask):
    """from_fn indices are positions: inside a cache, query i of sequence b is at start[b] + i."""
    fn = masks.from_fn(lambda b, h, q, kv: (kv <= q) & ((q - kv) % 3 != 2))
    m = fn if mask == "from_fn" else masks.causal() & fn
    mha = attnkit.MultiHeadAttention(32, 4).eval()
    worst, _ = mixed_fill_decode(mha, m, None)
    assert worst < 1e-5


# regression: finding F3 of the review of the seams between features
def test_bias_cached_semantics():
    start = torch.tensor([3, 0])
    b = bias.relative(torch.randn(8, 2), 8, 16)
    got = bias.cached(b, start).dense(2, 2, 1, 4, "cpu")  # one query per sequence, 4 key slots
    for s in range(2):  # query at position start[s] over keys 0..3
        want = b.dense(1, 2, 1, int(start[s]) + 1, "cpu")[0, :, 0]  # its own prefix, bottom-right
        torch.testing.assert_close(got[s, :, 0, : int(start[s]) + 1], want)
    top_left = bias.alibi(torch.tensor([0.5, 0.25]), align="top_left")
    assert bias.cached(top_left, start) is top_left  # explicit positions are kept
    with pytest.raises(TypeError, match="cached\\(\\) takes an attnkit.bias object"):
        bias.cached(torch.zeros(2, 2), start)
