"""score_mod: any fn(score, b, h, q_idx, kv_idx) -> score, on the tiled and reference kernels,
against a float64 formula written here and against attention-gym's score mods (their
published formulas, written out here)."""

from __future__ import annotations

import pytest
import torch
from _oracle import TILED_KERNELS, randn

import attnkit
from attnkit import bias, masks
from attnkit.score_mods import ScoreMod

NEG_INF = float("-inf")


def formula(q, k, v, allowed, modify, scale=None):
    """softmax(modify(q k^T scale, b, h, i, j) with hidden pairs -inf) @ v, in q's dtype, written out."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    s = q @ k.transpose(-2, -1) * scale
    b = torch.arange(s.shape[0]).view(-1, 1, 1, 1)
    h = torch.arange(s.shape[1]).view(1, -1, 1, 1)
    i = torch.arange(s.shape[2]).view(1, 1, -1, 1)
    j = torch.arange(s.shape[3]).view(1, 1, 1, -1)
    s = modify(s, b, h, i, j)
    if allowed is not None:
        s = s.masked_fill(~allowed, NEG_INF)
    w = torch.softmax(s, -1).nan_to_num(0.0)
    return w @ v


# attention-gym's score mods (attn_gym/mods), as published
def gym_alibi(num_heads):
    def alibi_mod(score, b, h, q_idx, kv_idx):
        scale = torch.exp2(-((h + 1) * 8.0 / num_heads))
        return score + (kv_idx - q_idx) * scale

    return alibi_mod


def gym_softcap(cap):
    def softcap_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return softcap_mod


MODS = {
    "gym_alibi": gym_alibi(4),
    "gym_softcap": gym_softcap(3.0),
    "relu": lambda s, b, h, i, j: torch.relu(s),
    "sigmoid_gate": lambda s, b, h, i, j: s * torch.sigmoid(s + 0.1 * h),
    "distance_decay": lambda s, b, h, i, j: s - 0.05 * (i - j).abs() * (h + 1),
    "per_sequence": lambda s, b, h, i, j: s + 0.7 * b,
    "hard_gate": lambda s, b, h, i, j: torch.where((i - j) % 3 == 0, s, s - 2.0),
}


@pytest.mark.parametrize("kernel", ["tiled", "reference", "auto"])
@pytest.mark.parametrize("mod", list(MODS))
@pytest.mark.parametrize("mask", [None, "causal", "document"])
def test_score_mods_against_the_formula(kernel, mod, mask):
    lq = 150
    m = {None: None, "causal": masks.causal(), "document": masks.document(torch.arange(lq) // 40)}[mask]
    q = randn(2, 4, lq, 16, dtype=torch.float64, requires_grad=True)
    k = randn(2, 2, lq, 16, dtype=torch.float64, requires_grad=True)
    v = randn(2, 2, lq, 8, dtype=torch.float64, requires_grad=True)
    out = attnkit.attention(q, k, v, m, score_mod=MODS[mod], kernel=kernel)
    want = formula(q, k, v, None if m is None else m.materialize(lq, lq), MODS[mod])
    assert (out - want).abs().max() <= 1e-12
    up = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), up)
    expected = torch.autograd.grad(want, (q, k, v), up)
    for a, b in zip(got, expected):
        assert (a - b).abs().max() <= 1e-10 * max(1.0, b.abs().max().item())


def test_attention_gym_alibi_equals_attnkits_alibi_bias():
    """attention-gym's ALiBi score mod is attnkit's causal-form ALiBi bias (slopes 2^(-8(h+1)/H))."""
    q, k, v = randn(1, 4, 200, 16), randn(1, 4, 200, 16), randn(1, 4, 200, 16)
    as_mod = attnkit.attention(q, k, v, masks.causal(), score_mod=gym_alibi(4))
    as_bias = attnkit.attention(q, k, v, masks.causal(), attn_bias=bias.alibi(bias.alibi_slopes(4), causal=True))
    torch.testing.assert_close(as_mod, as_bias, atol=2e-6, rtol=1e-5)


def test_softcap_score_mod_equals_softcap():
    q, k, v = randn(2, 2, 130, 16) * 4, randn(2, 2, 130, 16) * 4, randn(2, 2, 130, 16)
    torch.testing.assert_close(
        attnkit.attention(q, k, v, masks.causal(), score_mod=gym_softcap(5.0)),
        attnkit.attention(q, k, v, masks.causal(), softcap=5.0),
        atol=2e-6,
        rtol=1e-5,
    )


def test_a_function_written_for_vmap_runs_one_pair_at_a_time():
    """FlexAttention users write score mods for scalars (torch.vmap); attnkit detects them."""
    table = torch.randn(300, dtype=torch.float64)

    def relative(score, b, h, q_idx, kv_idx):
        if score.dim() != 0:  # this function only knows single pairs
            raise RuntimeError("scalars only")
        return score + table[q_idx - kv_idx + 150]

    q, k, v = (randn(1, 2, 150, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = attnkit.attention(q, k, v, masks.causal(), score_mod=relative, kernel="tiled")
    i, j = torch.arange(150)[:, None], torch.arange(150)[None, :]
    want = formula(q, k, v, masks.causal().materialize(150, 150), lambda s, b, h, ii, jj: s + table[i - j + 150])
    assert (out - want).abs().max() <= 1e-12
    (g,) = torch.autograd.grad(out.sum(), q)
    (w,) = torch.autograd.grad(want.sum(), q)
    assert (g - w).abs().max() <= 1e-10


def test_tensors_the_function_closes_over_get_gradients():
    w = torch.tensor([0.3, -0.2, 0.1, 0.4], dtype=torch.float64, requires_grad=True)
    mod = ScoreMod(lambda s, b, h, i, j: s * (1 + w[h]) - w[h] * (i - j).abs(), w)
    q, k, v = (randn(2, 4, 140, 8, dtype=torch.float64) for _ in range(3))
    grads = {}
    for kernel in ("tiled", "reference"):
        out = attnkit.attention(q, k, v, masks.sliding_window(30), score_mod=mod, kernel=kernel)
        (grads[kernel],) = torch.autograd.grad(out.square().sum(), w)
    assert (grads["tiled"] - grads["reference"]).abs().max() <= 1e-10
    assert torch.autograd.gradcheck(
        lambda w_: attnkit.attention(
            q[:, :, :20],
            k[:, :, :20],
            v[:, :, :20],
            masks.causal(),
            kernel="tiled",
            score_mod=ScoreMod(lambda s, b, h, i, j: s * (1 + w_[h]), w_),
        ),
        (w,),
    )


def test_score_mod_with_every_other_modification_and_capture():
    """score_mod after softcap and bias, before the mask; sinks on top; capture and stats see it."""
    mha = attnkit.MultiHeadAttention(32, 4, sinks=True).eval()
    x = randn(1, 40, 32)
    q, k, v = mha.project(x)
    mods = dict(
        attn_bias=bias.alibi(bias.alibi_slopes(4)), softcap=8.0, sinks=torch.randn(4), score_mod=MODS["sigmoid_gate"]
    )
    got = attnkit.attention(q, k, v, masks.causal(), kernel="tiled", **mods)
    want = attnkit.attention(q.double(), k.double(), v.double(), masks.causal(), kernel="reference", **mods)
    assert (got.double() - want).abs().max() <= 1e-5
    w = attnkit.attention_weights(q, k, v, masks.causal(), **mods)
    st = attnkit.inspect.attention_stats(q, k, v, masks.causal(), **mods)
    torch.testing.assert_close(st.max_weight, w.amax(-1), atol=1e-5, rtol=1e-5)


def test_explain_routes_score_mods_to_the_kernels_that_declare_them():
    q = randn(1, 2, 300, 16)
    plan = attnkit.explain(q, q, q, masks.causal(), score_mod=MODS["relu"])
    assert plan.kernel in TILED_KERNELS and "score_mod=<lambda>" in str(plan)
    assert plan.rejected["sdpa"] == ("no score_mod (a general score modification)",)
    with pytest.raises(ValueError, match="kernel='sdpa' cannot run this call: no score_mod"):
        attnkit.attention(q, q, q, score_mod=MODS["relu"], kernel="sdpa")


def test_bad_score_mods_get_clear_errors():
    q = randn(1, 2, 20, 8)
    with pytest.raises(TypeError, match="score_mod must be callable"):
        attnkit.attention(q, q, q, score_mod=3)
    with pytest.raises(ValueError, match="must return float scores of the tile's shape"):
        attnkit.attention(q, q, q, score_mod=lambda s, b, h, i, j: s[..., :1], kernel="reference")
    with pytest.raises(TypeError, match="ScoreMod params must be tensors"):
        ScoreMod(lambda s, b, h, i, j: s, 0.5)


# regression: finding F10 of the review of the seams between features
@pytest.mark.parametrize("kernel", ["tiled", "auto", "reference"])
def test_minus_inf_sink_with_a_fully_masked_row(kernel):
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


# regression: finding F11 of the review of the seams between features
@pytest.mark.parametrize("softcap", [1e39, 1e-39, 1e-300])
def test_softcap_outside_float32_is_refused(softcap):
    q = randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="softcap=.* cannot be represented in torch.float32"):
        attnkit.attention(q, q, q, softcap=softcap)
    out = attnkit.attention(q.double(), q.double(), q.double(), softcap=1e39)  # float64 holds it
    assert torch.isfinite(out).all()
