"""KVCache.compress: the kept entries, decoding over them at the true positions, and its refusals."""

from __future__ import annotations

import pytest
import torch
from _oracle import assert_oracle, naive_attention, oracle

import attnkit
from attnkit import bias, masks
from attnkit.inspect import kv_scores
from attnkit.nn import KVCache, RotaryEmbedding


def _filled(lengths=(7, 4), heads=2, d=4, max_len=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    k, v = torch.randn(b, heads, t, d, generator=g), torch.randn(b, heads, t, d, generator=g)
    cache = KVCache(b, heads, max_len, d)
    cache.append(k, v, counts=list(lengths))
    return cache, k, v


def _kept(scores, n, count):
    """The entries a loop keeps: the ``count`` best by score, ties to the earlier, in their order."""
    ranked = sorted(range(n), key=lambda j: (-float(scores[j]), j))[:count]
    return sorted(ranked)


@pytest.mark.parametrize("keep", [0.5, 3, 0.25, 1.0, 7])
def test_compress_keeps_the_best_entries_of_each_sequence_and_head_in_order(keep):
    lengths = (7, 4)
    cache, k, v = _filled(lengths)
    scores = torch.randn(2, 2, 7).round(decimals=1)  # ties happen: they go to the earlier entry
    scores[0, 1, 2] = scores[0, 1, 5]
    cache.compress(keep, scores)
    for b, n in enumerate(lengths):
        count = min(n, max(1, int(keep * n))) if isinstance(keep, float) else min(n, keep)
        assert int(cache.lengths[b]) == count
        assert int(cache.positions[b]) == n  # the next token's position is unchanged
        for h in range(2):
            index = _kept(scores[b, h], n, count)
            assert torch.equal(cache.keys[b, h, :count], k[b, h, index])
            assert torch.equal(cache.values[b, h, :count], v[b, h, index])
    assert cache.compressed == (keep not in (1.0, 7))


def test_compress_then_append_then_reset():
    cache, k, v = _filled((6, 6))
    cache.compress(2, torch.arange(12.0).view(1, 1, 12).expand(2, 2, 12)[..., :6].contiguous())
    assert cache.lengths.tolist() == [2, 2] and cache.dropped.tolist() == [4, 4]
    assert torch.equal(cache.keys[:, :, :2], k[:, :, 4:6])  # the two highest scores: the last two
    new_k, new_v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    cache.append(new_k, new_v)
    assert cache.lengths.tolist() == [5, 5] and cache.positions.tolist() == [9, 9]
    assert torch.equal(cache.stored()[0][:, :, 2:5], new_k)
    assert "dropped=[4, 4]" in repr(cache)
    cache.reset()
    assert cache.positions.tolist() == [0, 0] and not cache.compressed


def test_clone_is_independent():
    cache, k, _ = _filled((5, 5))
    copy = cache.clone()
    copy.compress(0.4, torch.randn(2, 2, 5))
    assert cache.lengths.tolist() == [5, 5] and copy.lengths.tolist() == [2, 2]
    assert torch.equal(cache.keys[:, :, :5], k[:, :, :5]) and not cache.compressed


def test_decoding_over_a_compressed_cache_is_attention_over_the_kept_keys_at_true_positions():
    """A rotary GQA layer: prefill 9 tokens, keep 4 per head, decode 2 more tokens at positions 9 and 10;
    each equals float64 attention over the kept (already rotated) keys and the new ones."""
    torch.manual_seed(3)
    rope = RotaryEmbedding(8, 100.0)
    mha = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2, rotary=rope).eval()
    x = torch.randn(2, 11, 32)
    cache = KVCache(2, 2, 16, 8)
    with torch.no_grad():
        mha(x[:, :9], mask=masks.causal(), cache=cache)
        q, k, v = mha.project(x)
        q, k = rope(q, torch.arange(11)), rope(k, torch.arange(11))
        scores = kv_scores(q[:, :, :9], k[:, :, :9], v[:, :, :9], masks.causal(), method="snapkv", window=3)
        cache.compress(4, scores)
        got = [mha(x[:, t : t + 1], mask=masks.causal(), cache=cache)[0] for t in (9, 10)]
    for step, t in enumerate((9, 10)):
        heads = []
        for b in range(2):
            per_head = []
            for h in range(2):
                index = _kept(scores[b, h], 9, 4) + list(range(9, t + 1))
                per_head.append((k[b, h, index], v[b, h, index]))
            kk = torch.stack([p[0] for p in per_head])[None]  # (1, Hkv, n, D)
            vv = torch.stack([p[1] for p in per_head])[None]
            heads.append(oracle(q[b : b + 1, :, t : t + 1].double(), kk.double(), vv.double()))
        w, b0 = mha.out_proj.weight.detach(), mha.out_proj.bias.detach()
        gold = torch.nn.functional.linear(mha.merge_heads(torch.cat(heads)), w.double(), b0.double())
        naive = torch.nn.functional.linear(mha.merge_heads(torch.cat(heads).float()), w, b0)
        assert_oracle(got[step], gold, naive, what=f"token {t}")


def test_compressed_cache_refuses_masks_and_biases_it_cannot_align():
    cache, _, _ = _filled((6, 6))
    cache.mask(masks.sliding_window(2))  # fine before compression
    cache.compress(0.5, torch.randn(2, 2, 6))
    cache.mask(masks.causal())
    cache.mask(None)
    with pytest.raises(ValueError, match="compressed: its entries are no longer at their positions"):
        cache.mask(masks.sliding_window(2))
    with pytest.raises(ValueError, match="position bias"):
        cache.bias(bias.alibi(torch.tensor([0.5, 0.25])))


@pytest.mark.parametrize(
    "keep,scores,exc,match",
    [
        (0.5, torch.randn(2, 2, 3), ValueError, r"scores must have shape \(2, 2, n\) with 7 <= n <= 12"),
        (0.5, torch.randn(2, 7), ValueError, "scores must have shape"),
        (0.5, torch.arange(14).view(2, 1, 7).expand(2, 2, 7), TypeError, "floating point"),
        (0.5, [[0.1]], TypeError, "floating point"),
        (1.5, torch.randn(2, 2, 7), ValueError, r"keep as a share must lie in \(0, 1\]"),
        (0.0, torch.randn(2, 2, 7), ValueError, r"keep as a share must lie in \(0, 1\]"),
        (9, torch.randn(2, 2, 7), ValueError, "nothing to drop"),
        (-1, torch.randn(2, 2, 7), ValueError, "keep must be >= 0"),
        (True, torch.randn(2, 2, 7), TypeError, "keep must be an int"),
        (0.5, torch.full((2, 2, 7), float("nan")), ValueError, "NaN"),
    ],
)
def test_compress_bad_input(keep, scores, exc, match):
    cache, _, _ = _filled()
    with pytest.raises(exc, match=match):
        cache.compress(keep, scores)
    assert cache.lengths.tolist() == [7, 4] and not cache.compressed  # nothing changed


def test_keep_zero_empties_the_cache_but_keeps_positions():
    cache, _, _ = _filled()
    cache.compress(0, torch.randn(2, 2, 7))
    assert cache.lengths.tolist() == [0, 0] and cache.positions.tolist() == [7, 4]
    q = torch.randn(2, 2, 1, 4)
    cache.append(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    k, v = cache.stored()
    got = attnkit.attention(q, k, v, cache.mask(masks.causal()))
    want, _ = naive_attention(q.double(), k[:, :, :1].double(), v[:, :, :1].double())
    torch.testing.assert_close(got.double(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capture_sees_the_compressed_cache_while_decoding(dtype):
    """capture and a compressed cache of mixed fills together: each decoding step's weights cover the
    kept entries and the new one of its own sequence, nothing past them, and sum to 1."""
    torch.manual_seed(5)
    mha = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2, dtype=dtype).eval()
    cache = KVCache(2, 2, 24, 8, dtype=dtype)
    x = torch.randn(2, 10, 32, dtype=dtype)
    with torch.no_grad():
        mha(x, mask=masks.causal(), cache=cache, counts=torch.tensor([10, 7]))
        cache.compress(0.5, torch.rand(2, 2, 10))
        assert cache.lengths.tolist() == [5, 3] and cache.positions.tolist() == [10, 7]
        with attnkit.capture(mha) as cap:
            mha(torch.randn(2, 1, 32, dtype=dtype), mask=masks.causal(), cache=cache)
    (w,) = cap.weights
    assert w.shape[-2] == 1 and w.shape[-1] >= 6
    torch.testing.assert_close(w.float().sum(-1), torch.ones(2, 4, 1), atol=1e-2, rtol=0)
    assert (w[0, ..., 6:] == 0).all() and (w[1, ..., 4:] == 0).all()  # 5 + 1 and 3 + 1 entries
    assert (w[0, ..., :6] > 0).all() and (w[1, ..., :4] > 0).all()


# --- per-head budgets (AdaKV) ---------------------------------------------------------------------


def _kept_per_head(scores, n, count, alpha):
    """AdaKV's allocation by a loop: each head its ``floor(alpha * count)`` best, then the best of what
    is left over every head (ties: the lower head, then the earlier entry) until ``count * heads``."""
    heads = scores.shape[0]
    ranked = [sorted(range(n), key=lambda j: (-float(scores[h, j]), j)) for h in range(heads)]
    floor = int(alpha * count)
    pool = sorted(
        ((-float(scores[h, ranked[h][r]]), h, r) for h in range(heads) for r in range(floor, n)),
    )
    counts = [floor] * heads
    for _, h, _ in pool[: count * heads - floor * heads]:
        counts[h] += 1
    return counts, [sorted(ranked[h][: counts[h]]) for h in range(heads)]


@pytest.mark.parametrize("alpha", [0.2, 0.0, 1.0])
def test_per_head_budgets_keep_adakvs_entries(alpha):
    lengths = (9, 6)
    cache, k, v = _filled(lengths, heads=3, max_len=14)
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(2, 3, 9, generator=g).round(decimals=1)
    scores[0, 2] += 1.5  # one head scores higher: it gets more of the budget
    cache.compress(4, scores, allocate="heads", alpha=alpha)
    for b, n in enumerate(lengths):
        counts, index = _kept_per_head(scores[b, :, :n], n, 4, alpha)
        assert cache.head_kept[b].tolist() == counts and sum(counts) == 4 * 3
        assert int(cache.lengths[b]) == max(counts) and int(cache.positions[b]) == n
        for h in range(3):
            assert torch.equal(cache.keys[b, h, : counts[h]], k[b, h, index[h]])
            assert torch.equal(cache.values[b, h, : counts[h]], v[b, h, index[h]])
    if alpha == 1.0:  # every head its own share: the uniform allocation
        assert (cache.head_kept == 4).all()
    else:
        assert cache.head_kept[0, 2] > 4


def test_decoding_over_per_head_budgets_is_attention_over_each_heads_kept_keys():
    """A rotary GQA layer (4 query heads, 2 KV heads), sequences of 9 and 7 tokens, 4 entries a head on
    average spread by AdaKV's rule; 2 decoded tokens against float64 attention over each KV head's own
    kept keys and the new ones (a query head of the group sees its KV head's entries only)."""
    torch.manual_seed(5)
    rope = RotaryEmbedding(8, 100.0)
    mha = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2, rotary=rope).eval()
    x = torch.randn(2, 11, 32)
    fills = [9, 7]
    cache = KVCache(2, 2, 16, 8)
    with torch.no_grad():
        mha(x[:, :9], mask=masks.causal(), cache=cache, counts=torch.tensor(fills))
        q, k, v = mha.project(x)
        scores = torch.randn(2, 2, 9)
        scores[1, 0] += 2.0
        cache.compress(4, scores, allocate="heads")
        assert cache.head_kept[1, 0] > cache.head_kept[1, 1]
        steps = [x[:, t : t + 1].clone() for t in (9, 10)]
        got = [mha(step, mask=masks.causal(), cache=cache)[0] for step in steps]
    for i in range(len(steps)):
        heads = []
        for b in range(2):
            n = fills[b]
            pos = torch.arange(n + i + 1)
            _, kept = _kept_per_head(scores[b, :, :n], n, 4, 0.2)
            xs = torch.cat([x[b : b + 1, :n]] + [s[b : b + 1] for s in steps[: i + 1]], dim=1)
            qq, kk, vv = mha.project(xs)
            qq, kk = rope(qq, pos), rope(kk, pos)
            for hq in range(4):
                hk = hq // 2
                index = kept[hk] + list(range(n, n + i + 1))
                heads.append(
                    oracle(
                        qq[:, hq : hq + 1, -1:].double(),
                        kk[:, hk : hk + 1, index].double(),
                        vv[:, hk : hk + 1, index].double(),
                    )
                )
        per_b = torch.cat(heads, dim=1).view(2, 4, 1, 8)
        w, b0 = mha.out_proj.weight.detach(), mha.out_proj.bias.detach()
        gold = torch.nn.functional.linear(mha.merge_heads(per_b), w.double(), b0.double())
        naive = torch.nn.functional.linear(mha.merge_heads(per_b.float()), w, b0)
        assert_oracle(got[i], gold, naive, what=f"step {i}")


def test_per_head_budgets_refuse_what_they_cannot_do():
    cache, _, _ = _filled((6, 6))
    with pytest.raises(ValueError, match="allocate must be one of"):
        cache.compress(2, torch.randn(2, 2, 6), allocate="layers")
    with pytest.raises(ValueError, match="alpha"):
        cache.compress(2, torch.randn(2, 2, 6), allocate="heads", alpha=1.5)
    copy = cache.clone()
    cache.compress(2, torch.randn(2, 2, 6), allocate="heads")
    assert copy.head_kept is None and cache.clone().head_kept is not None
    with pytest.raises(ValueError, match="cannot be compressed again"):
        cache.compress(1, torch.randn(2, 2, 6))
    with pytest.raises(ValueError, match="multiple of the cache's 2 KV heads"):
        cache.mask(masks.causal(), num_heads=3)
    cache.reset()
    assert cache.head_kept is None
