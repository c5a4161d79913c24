"""TODO"""

from __future__ import annotations

import pytest
import torch
from _oracle import BIASES, mixed_fill_decode, randn

import attnkit
from attnkit import bias, masks


# regression: finding F5 of the review of the seams between features
def test_capture_stats_inside_a_mixed_fill_cache():
    mha = attnkit.MultiHeadAttention(32, 4).eval()
    b = BIASES["relative"](4)
    torch.manual_seed(1)
    _, stats = mixed_fill_decode(mha, masks.causal(), b, steps=2, capture_mode="stats")
    torch.manual_seed(1)
    x = randn(2, 7, 32)  # the same draws as the helper's
    with torch.no_grad():
        for step, st in enumerate(stats):
            for s, n in ((0, 5 + step), (1, 2 + step)):
                _, w = mha(x[s : s + 1, : n + 1], mask=masks.causal(), attn_bias=b, need_weights=True)
                w = w[0, :, -1]  # (H, n + 1): the new token's row
                distance = (n - torch.arange(n + 1)).float()
                torch.testing.assert_close(st.mean_distance[s, :, 0], (w * distance).sum(-1), atol=1e-5, rtol=1e-5)


# regression: finding F4 of the review of the seams between features
@pytest.mark.parametrize("mode", ["weights", "rows", "stats"])
def test_capture_records_the_bias_softcap_and_sinks_of_the_call(mode):
    mha = attnkit.MultiHeadAttention(32, 4, softcap=5.0, sinks=True).eval()
    with torch.no_grad():
        mha.sinks.copy_(torch.randn(4))
    b = BIASES["relative"](4)
    x = randn(2, 7, 32)
    with torch.no_grad():
        _, w_true = mha(x, mask=masks.causal(), attn_bias=b, need_weights=True)
        kw = {"weights": {}, "rows": {"mode": "stats", "rows": [-1]}, "stats": {"mode": "stats"}}[mode]
        with attnkit.capture(mha, **kw) as cap:
            mha(x, mask=masks.causal(), attn_bias=b)
    if mode == "weights":
        torch.testing.assert_close(cap.weights[0], w_true)
    elif mode == "rows":
        torch.testing.assert_close(cap.weights[0], w_true[:, :, -1:])
    else:
        sink = 1 - w_true.sum(-1)  # the sink is one more outcome of each row
        entropy = -torch.special.xlogy(w_true, w_true).sum(-1) - torch.special.xlogy(sink, sink)
        torch.testing.assert_close(cap.stats[0].entropy, entropy, atol=1e-5, rtol=1e-5)


# regression: finding F4 of the review of the seams between features
def test_attention_hook_with_kwargs():
    mha = attnkit.MultiHeadAttention(16, 4, softcap=3.0)
    seen = []
    handle = mha.register_attention_hook(lambda m, q, k, v, mask, kw: seen.append(kw), with_kwargs=True)
    plain = mha.register_attention_hook(lambda m, q, k, v, mask: seen.append("plain"))
    b = bias.alibi(bias.alibi_slopes(4))
    mha(randn(1, 3, 16), attn_bias=b)
    handle.remove()
    plain.remove()
    assert seen[0]["attn_bias"] is b and seen[0]["softcap"] == 3.0 and seen[0]["sinks"] is None
    assert seen[1] == "plain"
