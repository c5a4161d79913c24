"""kv_scores against a float64 formula of each method, written here as kvpress defines it
(SnapKVPress, TOVAPress, ObservedAttentionPress ``score``), with masks, GQA, biases and padding."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _oracle import assert_oracle

import attnkit
from attnkit import bias, masks
from attnkit.inspect import kv_scores


def _weights(q, k, allowed, scale=None, add=None):
    """Dense softmax weights in q's dtype, the keys repeated per query head (``repeat_kv``)."""
    groups = q.shape[1] // k.shape[1]
    keys = k.repeat_interleave(groups, dim=1)
    s = q @ keys.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if add is not None:
        s = s + add
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0)


def formula(q, k, allowed, method, window=64, kernel_size=5, add=None):
    """kvpress's score, from the whole weight matrix (``allowed``: the dense mask of the call;
    ``add``: a dense additive bias on the scores)."""
    b, h, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    groups = h // hkv
    rows = {"snapkv": slice(lq - window, lq), "tova": slice(lq - 1, lq), "observed": slice(0, lq)}[method]
    w = _weights(q[:, :, rows], k, allowed[..., rows, :], add=None if add is None else add[..., rows, :])
    if method == "snapkv":
        w = w[..., : lk - window]
        scores = F.avg_pool1d(w.mean(dim=-2), kernel_size=kernel_size, padding=kernel_size // 2, stride=1)
        scores = scores.view(b, hkv, groups, lk - window).mean(2)
        return F.pad(scores, (0, window), value=scores.max().item() + 1)
    if method == "tova":
        scores = w[..., :-1].mean(1).repeat(1, hkv, 1)
        return F.pad(scores, (0, 1), value=scores.max().item() + 1)
    scores = w.sum(2) / torch.arange(lk, 0, -1, dtype=w.dtype)
    return scores.view(b, hkv, groups, lk).mean(2)


def _problem(b, h, hkv, length, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, length, 32, generator=g)
    k = torch.randn(b, hkv, length, 32, generator=g)
    return q, k, torch.randn(b, hkv, length, 32, generator=g)


def _check(got, q, k, allowed, method, what, **kw):
    gold = formula(q.double(), k.double(), allowed, method, **kw)
    naive = formula(q, k, allowed, method, **kw)
    assert got.shape == (q.shape[0], k.shape[1], k.shape[2])
    assert_oracle(got, gold, naive, what=what)


MASKS = {
    "causal (kvpress's prefill)": lambda b, n: masks.causal(),
    "causal & padding": lambda b, n: masks.causal() & masks.padding(torch.tensor([n - 37, n])[:b]),
    "sliding window": lambda b, n: masks.sliding_window(50, 0),
    "documents & causal": lambda b, n: masks.document(torch.arange(n) * 3 // n) & masks.causal(),
}


@pytest.mark.parametrize("method", ["snapkv", "tova", "observed"])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_scores_equal_kvpress_formula(method, heads, mask_name):
    b, length = 2, 300
    q, k, v = _problem(b, *heads, length, seed=len(mask_name) + heads[0])
    mask = MASKS[mask_name](b, length)
    allowed = mask.materialize(length, length)
    kw = {"window": 32, "kernel_size": 7} if method == "snapkv" else {}
    got = kv_scores(q, k, v, mask, method=method, **kw)
    _check(got, q, k, allowed, method, f"{method} {mask_name} {heads}", **kw)


@pytest.mark.parametrize("method", ["snapkv", "tova", "observed"])
def test_biases_and_float64(method):
    """An ALiBi bias enters the scores before the softmax, cut to the rows each method reads."""
    q, k, v = _problem(1, 4, 2, 200, seed=3)
    alibi = bias.alibi(torch.tensor([0.5, 0.25, 0.125, 0.0625]))
    allowed = masks.causal().materialize(200, 200)
    add = alibi.dense(1, 4, 200, 200, "cpu")
    kw = {"window": 16} if method == "snapkv" else {}
    got = kv_scores(q, k, v, masks.causal(), method=method, attn_bias=alibi, **kw)
    gold = formula(q.double(), k.double(), allowed, method, add=add.double(), **kw)
    naive = formula(q, k, allowed, method, add=add.float(), **kw)
    assert_oracle(got, gold, naive, what=f"{method} alibi")
    exact = kv_scores(q.double(), k.double(), v.double(), masks.causal(), method=method, attn_bias=alibi, **kw)
    assert exact.dtype == torch.float64
    assert_oracle(exact, gold, naive, what=f"{method} alibi float64")


def test_scores_use_no_weight_matrix(monkeypatch):
    """At L=4096 no tensor of Lq x Lk elements is made (the weights come from the tile reduction)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    q, k, v = _problem(1, 2, 1, 4096, seed=5)
    biggest = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    biggest.append(t.numel())
            return out

    with Sizes():
        for method in ("snapkv", "tova", "observed"):
            kv_scores(q, k, v, masks.causal(), method=method)
    assert max(biggest) < 4096 * 4096 // 8


def test_kept_keys_follow_the_scores():
    """The top keys of each method keep the window (snapkv) and the last key (tova)."""
    q, k, v = _problem(1, 2, 2, 128, seed=7)
    snap = kv_scores(q, k, v, masks.causal(), method="snapkv", window=16)
    kept = snap.topk(32, dim=-1).indices
    assert all(set(range(112, 128)) <= set(row.tolist()) for row in kept.reshape(-1, 32))
    tova = kv_scores(q, k, v, masks.causal(), method="tova")
    assert (tova[..., -1] > tova[..., :-1].max()).all()
    assert torch.equal(tova[:, 0], tova[:, 1])  # the same scores for each KV head


def test_bad_inputs_are_refused_with_their_values():
    q, k, v = _problem(1, 4, 2, 40, seed=9)
    with pytest.raises(ValueError, match="method must be one of"):
        kv_scores(q, k, v, method="h2o")
    with pytest.raises(ValueError, match="window=40"):
        kv_scores(q, k, v, method="snapkv", window=40)
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        kv_scores(q, k, v, method="snapkv", window=8, kernel_size=4)
    with pytest.raises(TypeError, match="4-D"):
        kv_scores(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="multiple of k's 3 heads"):
        kv_scores(q, torch.randn(1, 3, 40, 32), torch.randn(1, 3, 40, 32))
    with pytest.raises(ValueError, match="score_mod"):
        kv_scores(q, k, v, method="tova", score_mod=lambda s, b, h, i, j: s)
    prepared = attnkit.prepare(masks.causal(), 40, 40)
    with pytest.raises(TypeError, match="PreparedMask"):
        kv_scores(q, k, v, prepared, method="tova")
    cached = masks.cached(masks.causal(), torch.tensor([0]), torch.tensor([40]))
    with pytest.raises(ValueError, match=r"cannot be cut to those rows .* masks.causal\(\) for a prefill"):
        kv_scores(q, k, v, cached, method="snapkv", window=8)
    observed = kv_scores(q, k, v, cached, method="observed")  # every query: the mask as it is
    torch.testing.assert_close(observed, kv_scores(q, k, v, masks.causal(), method="observed"))


def test_knorm_is_minus_each_keys_norm_and_reads_no_query():
    """kvpress's KnormPress: ``-keys.norm(dim=-1)``; the queries (and the mask) do not enter."""
    q, k, v = _problem(2, 4, 2, 120, seed=9)
    got = kv_scores(q, k, v, masks.causal(), method="knorm")
    gold = -k.double().norm(dim=-1)
    naive = -torch.sqrt((k * k).sum(-1))
    assert_oracle(got, gold, naive, what="knorm")
    assert torch.equal(got, kv_scores(torch.randn_like(q), k, v, None, method="knorm"))
    assert kv_scores(q.double(), k.double(), v.double(), method="knorm").dtype == torch.float64


def test_layer_budgets_average_the_share():
    from attnkit.nn import layer_budgets

    for keep, layers in ((0.25, 4), (0.5, 6), (0.1, 2)):
        pyramid = layer_budgets(keep, layers, "pyramid")
        assert sum(pyramid) / layers == pytest.approx(keep)
        assert pyramid == sorted(pyramid, reverse=True) and pyramid[-1] == pytest.approx(keep / 20)
        assert layer_budgets(keep, layers) == [keep] * layers
    assert max(layer_budgets(0.9, 3, "pyramid")) == 1.0  # cut to 1
    with pytest.raises(ValueError, match="shape must be one of"):
        layer_budgets(0.5, 3, "adaptive")
    with pytest.raises(ValueError, match="keep must be a share"):
        layer_budgets(1.5, 3)
