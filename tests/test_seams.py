"""Regression tests of the defects found where two features meet (one test per finding,
named by its number F1..F24 in the review that found it). Each failed before its fix."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_oracle, gold_and_naive, naive_attention, randn, rounding_atol

import attnkit
from attnkit import bias, masks
from attnkit.inspect import attention_stats

NEG_INF = float("-inf")


# --- F1: q, k, v whose last dimension is strided -----------------------------------------


@pytest.mark.parametrize("kernel", ["tiled", "auto"])
@pytest.mark.parametrize("layout", ["transposed", "strided"])
@pytest.mark.parametrize("mask", ["window", "document", "padding"])
def test_f1_strided_last_dim(kernel, layout, mask):
    """(B, H, D, L).transpose(-1, -2) and x[..., ::2] equal their contiguous copies, with gradients."""
    length, d = 300, 16
    if layout == "transposed":
        q = randn(1, 2, d, length).transpose(-1, -2)
        k = randn(1, 2, d, length).transpose(-1, -2)
    else:
        q = randn(1, 2, length, 2 * d)[..., ::2]
        k = randn(1, 2, length, 2 * d)[..., ::2]
    v = randn(1, 2, length, 2 * d)[..., ::2]
    assert q.stride(-1) != 1 and v.stride(-1) != 1
    m = {
        "window": masks.sliding_window(30),
        "document": masks.document(torch.arange(length) // 70),
        "padding": masks.padding([250]),
    }[mask]
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    qc, kc, vc = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    out = attnkit.attention(qs, ks, vs, m, kernel=kernel)
    ref = attnkit.attention(qc, kc, vc, m, kernel="reference")
    gold, naive = gold_and_naive(qc, kc, vc, m.materialize(length, length))
    assert_oracle(out, gold, naive)
    go = torch.randn_like(out)
    out.backward(go)
    ref.backward(go)
    for a, b in ((qs, qc), (ks, kc), (vs, vc)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)


# --- F2, F9: biases of -inf, NaN and +inf -------------------------------------------------


@pytest.mark.parametrize("kernel", ["tiled", "auto", "reference"])
def test_f2_row_whose_kept_keys_all_have_minus_inf_bias_is_empty(kernel):
    q = randn(1, 2, 6, 8, requires_grad=True)
    k, v = randn(1, 2, 6, 8, requires_grad=True), randn(1, 2, 6, 8, requires_grad=True)
    b = torch.randn(1, 2, 6, 6)
    b[0, 1, 2, :] = NEG_INF  # head 1, query 2: every key's bias is -inf
    b[0, 0, 4, :3] = NEG_INF  # a row whose *visible* keys (causal: 0..4) are partly -inf
    out, lse = attnkit.attention(q, k, v, masks.causal(), attn_bias=b, kernel=kernel, return_lse=True)
    assert out[0, 1, 2].abs().max() == 0
    assert lse[0, 1, 2] == NEG_INF
    dense = masks.causal().materialize(6, 6) & (b != NEG_INF)
    gold, naive = gold_and_naive(q, k, v, torch.where(dense, b, NEG_INF))
    assert_oracle(out, gold, naive)
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert q.grad[0, 1, 2].abs().max() == 0  # the empty row gets no gradient
    st = attention_stats(q.detach(), k.detach(), v.detach(), masks.causal(), attn_bias=b, topk=2)
    assert st.lse[0, 1, 2] == NEG_INF
    assert st.entropy[0, 1, 2] == 0 and st.max_weight[0, 1, 2] == 0 and st.argmax[0, 1, 2] == -1
    assert (st.topk_keys[0, 1, 2] == -1).all()
    torch.testing.assert_close(st.lse[torch.isfinite(st.lse)], lse.detach()[torch.isfinite(lse)])


@pytest.mark.parametrize("kernel", ["tiled", "auto", "reference", "sdpa"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_f9_bias_values_at_hidden_pairs_are_never_read(kernel, poison):
    length = 140
    q, k, v = randn(1, 2, length, 16), randn(1, 2, length, 16), randn(1, 2, length, 16)
    m = masks.causal() & masks.sliding_window(40)
    keep = m.materialize(length, length)
    clean = torch.randn(1, 2, length, length, requires_grad=True)
    poisoned = torch.where(keep, clean.detach(), poison).requires_grad_()
    out = attnkit.attention(q, k, v, m, attn_bias=poisoned, kernel=kernel)
    ref = attnkit.attention(q, k, v, m, attn_bias=clean, kernel="reference")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if kernel != "sdpa":
        out.sum().backward()
        assert torch.isfinite(poisoned.grad).all()
        assert (poisoned.grad[~keep.expand_as(poisoned)] == 0).all()
    st = attention_stats(q, k, v, m, attn_bias=poisoned.detach())
    assert all(torch.isfinite(t).all() for t in (st.entropy, st.mean_distance, st.received))


# --- F10, F11: sinks of -inf, softcaps out of range ------------------------------------------


@pytest.mark.parametrize("kernel", ["tiled", "auto", "reference"])
def test_f10_minus_inf_sink_with_a_fully_masked_row(kernel):
    q, k, v = randn(1, 2, 4, 8, requires_grad=True), randn(1, 2, 4, 8), randn(1, 2, 4, 8)
    allowed = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    allowed[..., 1, :] = False  # query 1 sees no key
    sinks = torch.tensor([NEG_INF, 0.5], requires_grad=True)
    out, lse = attnkit.attention(q, k, v, allowed, sinks=sinks, kernel=kernel, return_lse=True)
    assert torch.isfinite(out).all()
    assert out[0, :, 1].abs().max() == 0
    assert lse[0, 0, 1] == NEG_INF and lse[0, 1, 1] == 0.5  # only the sink is left in that row
    out.sum().backward()
    assert torch.isfinite(sinks.grad).all() and torch.isfinite(q.grad).all()
    assert sinks.grad[0] == 0  # exp(-inf) = 0: the sink takes no mass whatever it moves
    ref = attnkit.attention(q.detach(), k, v, allowed, sinks=torch.tensor([-1e30, 0.5]), kernel="reference")
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("softcap", [1e39, 1e-39, 1e-300])
def test_f11_softcap_outside_float32_is_refused(softcap):
    q = randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="softcap=.* cannot be represented in torch.float32"):
        attnkit.attention(q, q, q, softcap=softcap)
    out = attnkit.attention(q.double(), q.double(), q.double(), softcap=1e39)  # float64 holds it
    assert torch.isfinite(out).all()


# --- F7: a bias on SDPA in half precision -------------------------------------------------------


def _alibi_problem():
    """12 heads (slopes 2^-0.5, ... that bfloat16 cannot hold) and causal ALiBi without a causal
    mask: keys after a query get a bias of up to +slope * 256, which bfloat16 rounds by whole units."""
    length = 257
    q, k, v = (randn(2, 12, length, 64) for _ in range(3))
    alibi = bias.alibi(bias.alibi_slopes(12), causal=True)
    gold = attnkit.attention(q.double(), k.double(), v.double(), attn_bias=alibi, kernel="reference")
    return (q.bfloat16(), k.bfloat16(), v.bfloat16()), alibi, gold


@pytest.mark.parametrize("kernel", ["sdpa", "auto"])
def test_f7_bf16_bias_on_sdpa_is_computed_in_float32(kernel):
    (q, k, v), alibi, gold = _alibi_problem()
    out = attnkit.attention(q, k, v, attn_bias=alibi, kernel=kernel)
    tiled = attnkit.attention(q, k, v, attn_bias=alibi, kernel="tiled")
    assert out.dtype == torch.bfloat16
    err, tiled_err = ((x.double() - gold).abs().max().item() for x in (out, tiled))
    assert err <= 2 * tiled_err + rounding_atol(gold, torch.bfloat16)  # was 0.59 (tiled: 0.013)


def test_f7_bf16_bias_under_torch_compile():
    (q, k, v), alibi, gold = _alibi_problem()
    compiled = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, attn_bias=alibi))
    out = compiled(q, k, v)
    tiled = attnkit.attention(q, k, v, attn_bias=alibi, kernel="tiled")
    err, tiled_err = ((x.double() - gold).abs().max().item() for x in (out, tiled))
    assert err <= 2 * tiled_err + rounding_atol(gold, torch.bfloat16)


# --- F14: second derivatives ----------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["auto", "sdpa", "tiled"])
def test_f14_double_backward_gives_one_clear_error(kernel):
    q = randn(1, 2, 64, 8, requires_grad=True)
    k, v = randn(1, 2, 64, 8), randn(1, 2, 64, 8)
    out = attnkit.attention(q, k, v, masks.causal(), kernel=kernel)
    with pytest.raises(ValueError, match="computes first derivatives only.*kernel='reference'"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    out = attnkit.attention(q, k, v, masks.causal(), kernel=kernel)  # first derivatives still work
    (g,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(g).all()


def test_f14_double_backward_through_the_reference_kernel():
    q = randn(1, 1, 5, 4, dtype=torch.float64, requires_grad=True)
    k, v = randn(1, 1, 5, 4, dtype=torch.float64), randn(1, 1, 5, 4, dtype=torch.float64)
    assert torch.autograd.gradgradcheck(lambda q: attnkit.attention(q, k, v, masks.causal(), kernel="reference"), (q,))


# --- F20: the math engine's gradients -------------------------------------------------------------


def _grads(fn, q, k, v, go, dtype):
    qq, kk, vv = (t.detach().clone().to(dtype).requires_grad_() for t in (q, k, v))
    fn(qq, kk, vv).backward(go.to(dtype))
    return [t.grad.double() for t in (qq, kk, vv)]


@pytest.mark.parametrize("mods", [{}, {"softcap": 5.0}, {"attn_bias": "alibi"}])
def test_f20_one_key_gives_exactly_zero_dq_and_dk(mods):
    """softmax over one key is 1 whatever the score: dQ and dK are exactly 0 (the naive formula's answer)."""
    mods = {"attn_bias": bias.alibi(bias.alibi_slopes(4))} if mods.get("attn_bias") else mods
    q, k, v = randn(1, 4, 33, 16) * 3, randn(1, 2, 1, 16), randn(1, 2, 1, 40)  # Dv != D: the math engine
    go = torch.randn(1, 4, 33, 40)
    dq, dk, dv = _grads(lambda a, b, c: attnkit.attention(a, b, c, kernel="tiled", **mods), q, k, v, go, torch.float32)
    assert dq.abs().max() == 0 and dk.abs().max() == 0
    torch.testing.assert_close(dv, go.double().reshape(1, 2, 66, 40).sum(2, keepdim=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask", [None, "causal", "window"])
def test_f20_math_engine_gradients_keep_the_rule(mask):
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


# --- F22: masks are values --------------------------------------------------------------------------


@pytest.mark.parametrize("length", [64, 300, 6000])
def test_f22_dense_mask_copies_its_tensor(length):
    t = torch.ones(length, length, dtype=torch.bool).tril()
    m = masks.dense(t)
    q = randn(1, 1, length, 8)
    before = attnkit.attention(q, q, q, m)
    t.fill_(True)  # the user's tensor changes; the mask does not
    after = attnkit.attention(q, q, q, m)
    torch.testing.assert_close(before, after, atol=0, rtol=0)
    torch.testing.assert_close(after, attnkit.attention(q, q, q, masks.causal(), kernel="reference"))


def test_f22_dense_mask_copy_keeps_broadcast_dimensions():
    base = torch.rand(1, 1, 512, 512) > 0.5
    m = masks.dense(base.expand(64, 16, 512, 512))  # 268M elements if materialised
    assert m.tensor.untyped_storage().nbytes() == 512 * 512
    assert m.tensor.shape == (64, 16, 512, 512)


# --- F23: the weights attention_with_weights returns are the output's -------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_f23_output_gradient_reaches_the_returned_weights(dtype, with_sinks):
    q, k, v = (randn(1, 2, 5, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    sinks = torch.tensor([0.3, -0.2]) if with_sinks else None
    out, w = attnkit.attention_with_weights(q, k, v, masks.causal(), sinks=sinks)
    w.retain_grad()
    out.float().sum().backward()
    assert w.grad is not None
    # out is computed from w: out == w @ v (up to the rounding of the matmul)
    torch.testing.assert_close(
        out.float(), w.float() @ v.float(), atol=2e-2 if dtype != torch.float32 else 1e-6, rtol=1e-2
    )


# --- F3, F5: a KV cache aligns masks, biases and statistics with each sequence's own end ----------


def _mixed_fill_decode(mha, mask, attn_bias, steps=4, capture_mode=None):
    """Decode a batch whose sequences hold 5 and 2 tokens; compare each step with recomputing the prefix.

    Returns (max difference of the outputs, per-step stats if ``capture_mode``)."""
    d = mha.d_model
    x = randn(2, 5 + steps, d)
    fills = [5, 2]
    cache = attnkit.KVCache(2, mha.num_kv_heads, 16, mha.head_dim)
    prompt = torch.zeros(2, 5, d)
    prompt[0], prompt[1, :2] = x[0, :5], x[1, :2]
    worst, stats = 0.0, []
    with torch.no_grad():
        mha(prompt, mask=mask, cache=cache, counts=torch.tensor(fills), attn_bias=attn_bias)
        for step in range(steps):
            new = torch.stack([x[0, 5 + step], x[1, 2 + step]])[:, None]
            if capture_mode:
                with attnkit.capture(mha, mode=capture_mode) as cap:
                    out, _ = mha(new, mask=mask, cache=cache, attn_bias=attn_bias)
                stats.append(cap.stats[0])
            else:
                out, _ = mha(new, mask=mask, cache=cache, attn_bias=attn_bias)
            for s, n in ((0, 5 + step), (1, 2 + step)):
                full, _ = mha(x[s : s + 1, : n + 1], mask=mask, attn_bias=attn_bias)
                worst = max(worst, (full[0, -1] - out[s, 0]).abs().max().item())
    return worst, stats


BIASES = {
    "relative": lambda h: bias.relative(torch.randn(32, h), 32, 128, bidirectional=False),
    "from_fn": lambda h: bias.from_fn(lambda b, hh, i, j: -0.3 * (i - j).abs().float()),
    "alibi+relative": lambda h: bias.alibi(bias.alibi_slopes(h)) + bias.relative(torch.randn(8, h), 8, 16),
}


@pytest.mark.parametrize("name", list(BIASES))
def test_f3_cached_decoding_with_a_bias_equals_recomputing(name):
    mha = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    worst, _ = _mixed_fill_decode(mha, masks.causal(), BIASES[name](4))
    assert worst < 1e-5


@pytest.mark.parametrize("mask", ["from_fn", "causal&from_fn"])
def test_f3_cached_decoding_with_a_from_fn_mask_equals_recomputing(mask):
    """from_fn indices are positions: inside a cache, query i of sequence b is at start[b] + i."""
    fn = masks.from_fn(lambda b, h, q, kv: (kv <= q) & ((q - kv) % 3 != 2))
    m = fn if mask == "from_fn" else masks.causal() & fn
    mha = attnkit.MultiHeadAttention(32, 4).eval()
    worst, _ = _mixed_fill_decode(mha, m, None)
    assert worst < 1e-5


def test_f3_bias_cached_semantics():
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


def test_f5_capture_stats_inside_a_mixed_fill_cache():
    mha = attnkit.MultiHeadAttention(32, 4).eval()
    b = BIASES["relative"](4)
    torch.manual_seed(1)
    _, stats = _mixed_fill_decode(mha, masks.causal(), b, steps=2, capture_mode="stats")
    torch.manual_seed(1)
    x = randn(2, 7, 32)  # the same draws as the helper's
    with torch.no_grad():
        for step, st in enumerate(stats):
            for s, n in ((0, 5 + step), (1, 2 + step)):
                _, w = mha(x[s : s + 1, : n + 1], mask=masks.causal(), attn_bias=b, need_weights=True)
                w = w[0, :, -1]  # (H, n + 1): the new token's row
                distance = (n - torch.arange(n + 1)).float()
                torch.testing.assert_close(st.mean_distance[s, :, 0], (w * distance).sum(-1), atol=1e-5, rtol=1e-5)


# --- F4: capture sees what the layer was called with -------------------------------------------------


@pytest.mark.parametrize("mode", ["weights", "rows", "stats"])
def test_f4_capture_records_the_bias_softcap_and_sinks_of_the_call(mode):
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


def test_f4_attention_hook_with_kwargs():
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


# --- F6: ring layers and rotary embeddings (one process; 2-4 ranks in test_distributed.py) ----------


def test_f6_ring_layer_applies_its_rotary_embedding():
    from attnkit.distributed import RingMultiHeadAttention
    from attnkit.nn import RotaryEmbedding

    ring = RingMultiHeadAttention(32, 4, rotary=RotaryEmbedding(8)).eval()
    plain = attnkit.MultiHeadAttention(32, 4, rotary=RotaryEmbedding(8)).eval()
    plain.load_state_dict(ring.state_dict())
    x = randn(2, 10, 32)
    torch.testing.assert_close(ring(x, mask=masks.causal())[0], plain(x, mask=masks.causal())[0])
    torch.testing.assert_close(
        ring(x, mask=masks.causal(), positions=torch.arange(10) + 3)[0],
        plain(x, mask=masks.causal(), positions=torch.arange(10) + 3)[0],
    )


# --- cosmetic findings: clear errors ---------------------------------------------------------------


def test_rows_and_heads_take_numpy_integers_and_refuse_huge_ones():
    np = pytest.importorskip("numpy")
    q = randn(1, 2, 5, 8)
    full = attnkit.attention_weights(q, q, q)
    torch.testing.assert_close(attnkit.attention_weights(q, q, q, rows=np.int64(3)), full[:, :, 3:4])
    torch.testing.assert_close(attnkit.attention_weights(q, q, q, heads=[np.int32(1)]), full[:, 1:2])
    with pytest.raises(ValueError, match=r"rows=\[100000000000000000000\] is out of range for 5"):
        attnkit.attention_weights(q, q, q, rows=[10**20])
    with pytest.raises(TypeError, match="rows must hold integer indices"):
        attnkit.attention_weights(q, q, q, rows=[1.5])


def test_prepare_on_the_meta_device_is_refused_clearly():
    with pytest.raises(ValueError, match="cannot make a PreparedMask on the meta device"):
        attnkit.prepare(masks.padding([3]), 8, 8, device="meta")


def test_ring_sinks_must_be_a_tensor():
    from attnkit.distributed import ring_attention

    q = randn(1, 2, 5, 8)
    with pytest.raises(TypeError, match=r"sinks must be a float tensor of shape \(Hq,\) = \(2,\)"):
        ring_attention(q, q, q, sinks=[0.0, 0.0])


def test_ring_error_names_each_peer_once():
    from attnkit.distributed.ring import _Group

    message = str(_Group(None, 5).error(1, "receiving from rank 1", None))
    assert message.count("rank 1") == 1 and "It may have died" in message
    assert "Rank 1 and rank 2 may have died" in str(_Group(None, 5).error([1, 2], "gathering", None))
