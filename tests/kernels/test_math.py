"""TODO"""

from __future__ import annotations

import pytest
import torch
from _oracle import (
    naive_attention,
    randn,
    rounding_atol,
)

import attnkit
from attnkit import bias, masks


# regression: a finding of the adversarial review of the inputs (hardening)
def test_math_engine_dq_error_is_within_twice_sdpas():
    """The tiled math engine (here for Dv != D) against SDPA, both measured against float64."""
    import statistics

    import torch.nn.functional as F

    ratios = []
    mask = masks.sliding_window(32)
    dense = mask.materialize(512, 512)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        q, k = (torch.randn(1, 2, 512, 8, generator=g, dtype=torch.float64) for _ in range(2))
        v, grad = (torch.randn(1, 2, 512, 4, generator=g, dtype=torch.float64) for _ in range(2))

        def dq(fn, dtype):
            qq, kk, vv = (t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v))
            fn(qq, kk, vv).backward(grad.to(dtype))
            return qq.grad.double()

        gold = dq(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=dense), torch.float64)
        sdpa = dq(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=dense), torch.float32)
        ours = dq(lambda a, b, c: attnkit.attention(a, b, c, mask, kernel="tiled"), torch.float32)
        ratios.append((ours - gold).abs().max().item() / (sdpa - gold).abs().max().item())
    assert statistics.median(ratios) <= 2.0 and max(ratios) <= 3.0, ratios


def _grads(fn, q, k, v, go, dtype):
    qq, kk, vv = (t.detach().clone().to(dtype).requires_grad_() for t in (q, k, v))
    fn(qq, kk, vv).backward(go.to(dtype))
    return [t.grad.double() for t in (qq, kk, vv)]


# regression: finding F20 of the review of the seams between features
@pytest.mark.parametrize("mods", [{}, {"softcap": 5.0}, {"attn_bias": "alibi"}])
def test_one_key_gives_exactly_zero_dq_and_dk(mods):
    """softmax over one key is 1 whatever the score: dQ and dK are exactly 0 (the naive formula's answer)."""
    mods = {"attn_bias": bias.alibi(bias.alibi_slopes(4))} if mods.get("attn_bias") else mods
    q, k, v = randn(1, 4, 33, 16) * 3, randn(1, 2, 1, 16), randn(1, 2, 1, 40)  # Dv != D: the math engine
    go = torch.randn(1, 4, 33, 40)
    dq, dk, dv = _grads(lambda a, b, c: attnkit.attention(a, b, c, kernel="tiled", **mods), q, k, v, go, torch.float32)
    assert dq.abs().max() == 0 and dk.abs().max() == 0
    torch.testing.assert_close(dv, go.double().reshape(1, 2, 66, 40).sum(2, keepdim=True), atol=1e-5, rtol=1e-5)


# regression: finding F20 of the review of the seams between features
@pytest.mark.parametrize("mask", [None, "causal", "window"])
def test_math_engine_gradients_keep_the_rule(mask):
    """TESTING.md's gradient rule (3x the naive formula's error + one rounding), Dv != D."""
    m = {None: None, "causal": masks.causal(), "window": masks.sliding_window(20)}[mask]
    for lq, lk in ((130, 130), (97, 191), (188, 9)):
        q, k, v = randn(2, 4, lq, 16), randn(2, 2, lk, 16), randn(2, 2, lk, 8)
        go = torch.randn(2, 4, lq, 8)
        dense = None if m is None else m.materialize(lq, lk)
        gold = _grads(lambda a, b, c: naive_attention(a, b, c, dense)[0], q, k, v, go, torch.float64)
        naive = _grads(lambda a, b, c: naive_attention(a, b, c, dense)[0], q, k, v, go, torch.float32)
        out = _grads(lambda a, b, c: attnkit.attention(a, b, c, m, kernel="tiled"), q, k, v, go, torch.float32)
        for name, g, n, o in zip("qkv", gold, naive, out):
            bound = 3 * (n - g).abs().max().item() + rounding_atol(g, torch.float32)
            assert (o - g).abs().max().item() <= bound, (name, lq, lk)


def test_tiled_dropout_kept_fraction_and_reproducibility():
    p = 0.2
    q, k = randn(2, 4, 300, 8), randn(2, 4, 300, 8)
    v = torch.eye(300).expand(2, 4, 300, 300)
    mask = masks.sliding_window(40)
    torch.manual_seed(5)
    out = attnkit.attention(q, k, v, mask, dropout_p=p, kernel="tiled")
    torch.manual_seed(5)
    assert torch.equal(out, attnkit.attention(q, k, v, mask, dropout_p=p, kernel="tiled"))
    inside = mask.materialize(300, 300).expand_as(out)
    kept = (out[inside] != 0).double().mean().item()
    n = inside.sum().item()
    assert abs(kept - (1 - p)) < 6 * (p * (1 - p) / n) ** 0.5
    assert (out[~inside] == 0).all()
