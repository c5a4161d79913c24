"""Score modifications: attn_bias (alibi, relative, from_fn, dense, sums), softcap and sinks.

The oracle is the formula written out here in float64, with each bias computed the
way the model it comes from defines it (BLOOM's ALiBi, T5's buckets, gpt-oss's sink
softmax, Gemma 2's soft-capping), independently of attnkit.
"""

from __future__ import annotations

import math

import pytest
import torch
from _oracle import (
    NEG_INF,
    TILED_KERNELS,
    FusedCalls,
    MaxNumel,
    alibi_formula,
    assert_oracle,
    gold_and_naive,
    oracle,
    randn,
    relative_formula,
    rounding_atol,
    t5_bucket,
)

import attnkit
from attnkit import bias, masks
from attnkit.inspect import attention_stats

B, HQ, HKV, L, D = 2, 4, 2, 150, 16  # 150: several row blocks (128) and key blocks (64)


# --- the formulas, written plainly -------------------------------------------------------


def bloom_slopes(n):
    """The slopes of the ALiBi paper / BLOOM: 2^(-8 i / n) for a power of two n, interleaved otherwise."""

    def geometric(m):
        first = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [first ** (i + 1) for i in range(m)]

    if math.log2(n).is_integer():
        return geometric(n)
    below = 2 ** math.floor(math.log2(n))
    return geometric(below) + geometric(2 * below)[0::2][: n - below]


MASKS = {
    "none": lambda: None,
    "causal": lambda: masks.causal(),
    "window": lambda: masks.sliding_window(16),
    "document": lambda: masks.document(torch.tensor([[0] * 50 + [1] * 70 + [2] * 30, [0] * 100 + [1] * 50])),
    "padding": lambda: masks.padding(torch.tensor([150, 97])),
}


def allowed_of(mask, lq, lk):
    return None if mask is None else attnkit.prepare(mask, lq, lk).materialize()


def make_mods(kind, dtype=torch.float64, lq=L, lk=L):
    """(attnkit kwargs, oracle kwargs, learnable tensors) for one kind of modification."""
    slopes = bias.alibi_slopes(HQ).to(dtype).requires_grad_()
    table = (0.5 * torch.randn(32, HQ, dtype=torch.float64)).to(dtype).requires_grad_()
    sinks = torch.randn(HQ, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(HQ, dtype=torch.float64).to(dtype).requires_grad_()
    dense_t = torch.randn(B, 1, lq, lk, dtype=torch.float64).to(dtype).requires_grad_()
    fn = lambda b, h, i, j: weight[h] * torch.cos(0.1 * (i - j).to(weight.dtype))  # noqa: E731
    fn_formula = weight.double().view(-1, 1, 1) * torch.cos(
        0.1 * (torch.arange(lq)[:, None] - torch.arange(lk)[None, :]).double()
    )
    table_ = {
        "alibi": (dict(attn_bias=bias.alibi(slopes)), dict(add=alibi_formula(slopes, lq, lk)), [slopes]),
        "alibi_causal": (
            dict(attn_bias=bias.alibi(slopes, causal=True)),
            dict(add=alibi_formula(slopes, lq, lk, causal=True)),
            [slopes],
        ),
        "relative": (dict(attn_bias=bias.relative(table)), dict(add=relative_formula(table, lq, lk)), [table]),
        "relative_uni": (
            dict(attn_bias=bias.relative(table, bidirectional=False)),
            dict(add=relative_formula(table, lq, lk, bidirectional=False)),
            [table],
        ),
        "from_fn": (dict(attn_bias=bias.from_fn(fn, weight)), dict(add=fn_formula), [weight]),
        "dense": (dict(attn_bias=bias.dense(dense_t)), dict(add=dense_t.double()), [dense_t]),
        "softcap": (dict(softcap=2.0), dict(softcap=2.0), []),
        "sinks": (dict(sinks=sinks), dict(sinks=sinks.double()), [sinks]),
        "all": (
            dict(attn_bias=bias.alibi(slopes) + bias.relative(table), softcap=3.0, sinks=sinks),
            dict(
                add=alibi_formula(slopes, lq, lk) + relative_formula(table, lq, lk), softcap=3.0, sinks=sinks.double()
            ),
            [slopes, table, sinks],
        ),
    }
    return table_[kind]


KINDS = ["alibi", "alibi_causal", "relative", "relative_uni", "from_fn", "dense", "softcap", "sinks", "all"]


def _grads(out, tensors, seed=0):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad(out, tensors, g, allow_unused=True)


# --- every modification with every mask, against the formula -----------------------------


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("kind", KINDS)
def test_float64_every_kernel_equals_the_formula(kind, mask_name):
    q = randn(B, HQ, L, D, dtype=torch.float64, requires_grad=True)
    k, v = (randn(B, HKV, L, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    ours, theirs, learned = make_mods(kind)
    mask = MASKS[mask_name]()
    want = oracle(q, k, v, allowed_of(mask, L, L), **theirs)
    want_grads = _grads(want, [q, k, v, *learned])
    kernels = ["tiled", "reference"] + (["sdpa"] if set(ours) == {"attn_bias"} else [])
    for kernel in kernels:
        out = attnkit.attention(q, k, v, mask, kernel=kernel, **ours)
        assert (out - want).abs().max() < 1e-12, kernel
        for got, exp in zip(_grads(out, [q, k, v, *learned]), want_grads):
            assert (got - exp).abs().max() < 1e-10, kernel
    assert attnkit.explain(q, k, v, mask, **ours).kernel in TILED_KERNELS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["alibi_causal", "relative", "softcap", "sinks", "all"])
def test_low_precision_within_the_oracle_rule(kind, dtype):
    q = randn(B, HQ, L, D, dtype=dtype, requires_grad=True)
    k, v = (randn(B, HKV, L, D, dtype=dtype, requires_grad=True) for _ in range(2))
    ours, theirs, learned = make_mods(kind, dtype)
    mask = masks.sliding_window(40)
    allowed = allowed_of(mask, L, L)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))  # gold's gradients in float64
    gold = oracle(q64, k64, v64, allowed, **theirs)
    naive = oracle(
        q, k, v, allowed, **{n: (t.to(dtype) if isinstance(t, torch.Tensor) else t) for n, t in theirs.items()}
    )
    out = attnkit.attention(q, k, v, mask, **ours)
    assert_oracle(out, gold, naive, what=f"{kind} {dtype}")
    gold_g, naive_g, out_g = _grads(gold, [q64, k64, v64]), _grads(naive, [q, k, v]), _grads(out, [q, k, v])
    for name, o, g, n in zip("qkv", out_g, gold_g, naive_g):
        assert_oracle(o, g, n, factor=3.0, what=f"d{name} {kind} {dtype}")


@pytest.mark.parametrize("kind", ["alibi", "relative", "from_fn", "all"])
def test_offsets_decoding_and_gqa(kind):
    """Lq != Lk (bottom-right: the queries are the last positions) and per-sequence offsets."""
    lq = 5
    q = randn(B, HQ, lq, D, dtype=torch.float64)
    k, v = (randn(B, HKV, L, D, dtype=torch.float64) for _ in range(2))
    ours, theirs, _ = make_mods(kind, lq=lq)
    for kernel in ["tiled", "reference"]:
        out = attnkit.attention(q, k, v, masks.causal(), kernel=kernel, **ours)
        want = oracle(q, k, v, torch.ones(lq, L, dtype=torch.bool).tril(L - lq), **theirs)
        assert (out - want).abs().max() < 1e-12
    slopes = bias.alibi_slopes(HQ).double()
    offsets = torch.tensor([3, 11])
    got = attnkit.attention(q, k, v, attn_bias=bias.alibi(slopes, q_offset=offsets, kv_offset=2))
    for b in range(B):
        want = oracle(
            q[b : b + 1],
            k[b : b + 1],
            v[b : b + 1],
            add=alibi_formula(slopes, lq, L, q_offset=int(offsets[b]), kv_offset=2),
        )
        assert (got[b : b + 1] - want).abs().max() < 1e-12


# --- biases of the distance alone on the fused engine (a band as its additive mask) -----------

BAND_KINDS = ["alibi", "alibi_causal", "relative", "relative_uni", "alibi+relative"]


def band_bias(kind, dtype, lq, lk):
    """(bias, (H, Lq, Lk) float64 formula) with no tensor wanting a gradient: the fused backward runs."""
    slopes = bias.alibi_slopes(HQ).to(dtype)
    table = (0.5 * torch.randn(32, HQ, dtype=torch.float64)).to(dtype)
    parts = {
        "alibi": (bias.alibi(slopes), alibi_formula(slopes, lq, lk)),
        "alibi_causal": (bias.alibi(slopes, causal=True), alibi_formula(slopes, lq, lk, causal=True)),
        "relative": (bias.relative(table), relative_formula(table, lq, lk)),
        "relative_uni": (
            bias.relative(table, bidirectional=False),
            relative_formula(table, lq, lk, bidirectional=False),
        ),
    }
    if kind == "alibi+relative":
        return parts["alibi"][0] + parts["relative"][0], parts["alibi"][1] + parts["relative"][1]
    return parts[kind]


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("kind", BAND_KINDS)
def test_a_band_bias_runs_on_the_fused_engine_float64(kind, mask_name, monkeypatch, request):
    from attnkit.kernels.runs import aten as _aten

    q = randn(B, HQ, L, D, dtype=torch.float64, requires_grad=True)
    k, v = (randn(B, HKV, L, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    the_bias, formula = band_bias(kind, torch.float64, L, L)
    mask = MASKS[mask_name]()
    want = oracle(q, k, v, allowed_of(mask, L, L), add=formula)
    want_grads = _grads(want, [q, k, v])
    calls = FusedCalls(monkeypatch, request)
    out = attnkit.attention(q, k, v, mask, attn_bias=the_bias, kernel="tiled")
    assert (out - want).abs().max() < 1e-12
    for got, exp in zip(_grads(out, [q, k, v]), want_grads):
        assert (got - exp).abs().max() < 1e-10
    if _aten.AVAILABLE:
        assert calls.masked > 0, "the band bias should have run on the fused engine"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", BAND_KINDS)
@pytest.mark.parametrize("mask_name", ["causal", "window", "document"])
def test_a_band_bias_within_the_oracle_rule(kind, mask_name, dtype):
    q = randn(B, HQ, L, D, dtype=dtype, requires_grad=True)
    k, v = (randn(B, HKV, L, D, dtype=dtype, requires_grad=True) for _ in range(2))
    the_bias, formula = band_bias(kind, dtype, L, L)
    mask = MASKS[mask_name]()
    allowed = allowed_of(mask, L, L)
    gold = oracle(q.double(), k.double(), v.double(), allowed, add=formula)
    naive = oracle(q, k, v, allowed, add=formula.to(dtype))
    out = attnkit.attention(q, k, v, mask, attn_bias=the_bias, kernel="tiled")
    assert_oracle(out, gold, naive, what=f"{kind} {dtype}")
    for name, o, g, n in zip("qkv", *(_grads(x, [q, k, v]) for x in (out, gold, naive))):
        assert_oracle(o, g, n, factor=3.0, what=f"d{name} {kind} {dtype}")


@pytest.mark.parametrize("lq, lk, align", [(1, 113, "bottom_right"), (7, 300, "bottom_right"), (300, 170, "top_left")])
def test_a_band_bias_with_other_lengths_offsets_and_per_head_masks(lq, lk, align, monkeypatch):
    """Lq != Lk in both alignments with int offsets, and a mask whose heads differ (groups of heads)."""
    q = randn(B, HQ, lq, D, dtype=torch.float64, requires_grad=True)
    k, v = (randn(B, HKV, lk, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    slopes = bias.alibi_slopes(HQ).double()
    the_bias = bias.alibi(slopes, align=align, q_offset=3, kv_offset=1)
    shift = (lk - lq if align == "bottom_right" else 0) + 3 - 1
    i = torch.arange(lq, dtype=torch.float64)[:, None] + shift
    j = torch.arange(lk, dtype=torch.float64)[None, :]
    formula = -slopes.view(-1, 1, 1) * (i - j).abs()
    width = torch.tensor([5, 40, 90, 400])
    mask = masks.from_fn(lambda b, h, qi, kj: (qi + (lk - lq) - kj).abs() <= width.to(qi.device)[h], num_heads=HQ)
    allowed = allowed_of(mask, lq, lk)
    want = oracle(q, k, v, allowed, add=formula)
    out = attnkit.attention(q, k, v, mask, attn_bias=the_bias, kernel="tiled")
    assert (out - want).abs().max() < 1e-12
    for got, exp in zip(_grads(out, [q, k, v]), _grads(want, [q, k, v])):
        assert (got - exp).abs().max() < 1e-10


def test_a_band_with_minus_infinity_or_per_sequence_offsets_stays_exact():
    """A table entry of -inf empties rows (the fused engine would answer them 0 with lse 0):
    such a band, and per-sequence offsets, run on the math engine and stay exact."""
    q = randn(B, HQ, L, D, dtype=torch.float64)
    k, v = (randn(B, HKV, L, D, dtype=torch.float64) for _ in range(2))
    table = torch.randn(32, HQ, dtype=torch.float64)
    table[:, 1] = float("-inf")  # head 1: every pair hidden
    mask = masks.sliding_window(16)
    out, lse = attnkit.attention(q, k, v, mask, attn_bias=bias.relative(table), return_lse=True)
    want = oracle(q, k, v, allowed_of(mask, L, L), add=relative_formula(table, L, L))
    assert (out - want).abs().max() < 1e-12
    assert torch.isneginf(lse[:, 1]).all() and (out[:, 1] == 0).all()
    slopes = bias.alibi_slopes(HQ).double()
    offsets = torch.tensor([0, 9])
    got = attnkit.attention(q, k, v, mask, attn_bias=bias.alibi(slopes, q_offset=offsets))
    for b in range(B):
        want = oracle(
            q[b : b + 1],
            k[b : b + 1],
            v[b : b + 1],
            allowed_of(mask, L, L),
            add=alibi_formula(slopes, L, L, q_offset=int(offsets[b])),
        )
        assert (got[b : b + 1] - want).abs().max() < 1e-12


def test_band_of_a_bias_is_its_distance_function():
    """``Bias.band`` column t is the bias of every pair with kv - q = t - (Lq - 1)."""
    slopes = bias.alibi_slopes(HQ).double()
    table = torch.randn(32, HQ, dtype=torch.float64)
    for the_bias in (bias.alibi(slopes), bias.relative(table) + bias.alibi(slopes, causal=True, kv_offset=4)):
        for lq, lk in ((9, 9), (3, 20), (20, 3)):
            band = the_bias.band(HQ, lq, lk)
            dense = the_bias.dense(1, HQ, lq, lk, "cpu")[0]
            i, j = torch.meshgrid(torch.arange(lq), torch.arange(lk), indexing="ij")
            assert torch.equal(band[:, j - i + lq - 1], dense)
    assert bias.from_fn(lambda b, h, i, j: (i - j).double()).band(HQ, 4, 4) is None
    assert bias.dense(torch.randn(4, 4)).band(HQ, 4, 4) is None
    assert bias.alibi(slopes, q_offset=torch.tensor([1, 2])).band(HQ, 4, 4) is None


def test_rank_2_and_3_inputs():
    q, k, v = (randn(37, 8, dtype=torch.float64) for _ in range(3))
    slopes = torch.tensor([0.3], dtype=torch.float64)
    out = attnkit.attention(
        q,
        k,
        v,
        masks.causal(),
        attn_bias=bias.alibi(slopes),
        softcap=4.0,
        sinks=torch.tensor([0.5], dtype=torch.float64),
    )
    want = oracle(
        q[None, None],
        k[None, None],
        v[None, None],
        torch.ones(37, 37, dtype=torch.bool).tril(),
        add=alibi_formula(slopes, 37, 37),
        softcap=4.0,
        sinks=torch.tensor([0.5], dtype=torch.float64),
    )
    assert out.shape == (37, 8) and (out - want[0, 0]).abs().max() < 1e-12
    q3 = randn(3, 20, 8, dtype=torch.float64)
    table = torch.randn(32, 3, dtype=torch.float64)
    out = attnkit.attention(q3, q3, q3, attn_bias=bias.relative(table))
    assert (out - oracle(q3[None], q3[None], q3[None], add=relative_formula(table, 20, 20))[0]).abs().max() < 1e-12


# --- gradients ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["alibi_softcap_sinks_causal", "relative_dense_document", "from_fn_window"])
def test_gradcheck_every_learnable_tensor(case):
    lq = lk = 24
    q = randn(2, 2, lq, 4, dtype=torch.float64, requires_grad=True)
    k, v = (randn(2, 1, lk, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    slopes = torch.tensor([0.25, 0.0625], dtype=torch.float64, requires_grad=True)
    table = randn(8, 2, dtype=torch.float64, requires_grad=True)
    sinks = randn(2, dtype=torch.float64, requires_grad=True)
    dense_t = randn(1, 2, lq, lk, dtype=torch.float64, requires_grad=True)
    weight = randn(2, dtype=torch.float64, requires_grad=True)
    if case == "alibi_softcap_sinks_causal":
        mask, tensors = masks.causal(), (q, k, v, slopes, sinks)
        mods = lambda t: dict(attn_bias=bias.alibi(t[3]), softcap=1.5, sinks=t[4])  # noqa: E731
    elif case == "relative_dense_document":
        mask, tensors = masks.document(torch.tensor([0] * 10 + [1] * 14)), (q, k, v, table, dense_t)
        mods = lambda t: dict(attn_bias=bias.relative(t[3], 8, 16) + bias.dense(t[4]))  # noqa: E731
    else:
        mask, tensors = masks.sliding_window(5), (q, k, v, weight)
        mods = lambda t: dict(attn_bias=bias.from_fn(lambda b, h, i, j: t[3][h] * (i - j).double().sin(), t[3]))  # noqa: E731
    prepared = attnkit.prepare(mask, lq, lk, block_size=(8, 8))  # several tiles, full and partial
    for kernel in ["tiled", "reference"]:
        fn = lambda *t: attnkit.attention(t[0], t[1], t[2], prepared, kernel=kernel, **mods(t))  # noqa: E731
        assert torch.autograd.gradcheck(fn, tensors, atol=1e-8)


def test_tiled_bias_gradient_of_a_parameter_used_twice():
    slopes = bias.alibi_slopes(HQ).double().requires_grad_()
    q, k, v = (randn(1, HQ, 90, 8, dtype=torch.float64) for _ in range(3))
    attn_bias = bias.alibi(slopes) + bias.alibi(slopes, causal=True)
    for kernel in ["tiled", "reference"]:
        slopes.grad = None
        attnkit.attention(q, k, v, masks.causal(), attn_bias=attn_bias, kernel=kernel).square().sum().backward()
        if kernel == "tiled":
            tiled_grad = slopes.grad.clone()
    assert torch.allclose(tiled_grad, slopes.grad, atol=1e-12)


# --- edge values ----------------------------------------------------------------------------


def test_softcap_with_huge_scores_stays_finite():
    q, k, v = (randn(1, 2, 130, 16, requires_grad=True) for _ in range(3))
    qs, ks = q * 100, k * 100  # |q . k| * scale ~ 1e4
    out = attnkit.attention(qs, ks, v, masks.causal(), softcap=30.0)
    want = oracle(qs.double(), ks.double(), v.double(), torch.ones(130, 130, dtype=torch.bool).tril(), softcap=30.0)
    assert torch.isfinite(out).all() and (out.double() - want).abs().max() < 1e-4
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_sinks_with_fully_masked_rows_give_zero_and_zero_gradients():
    q, k, v = (randn(2, HQ, 70, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = randn(HQ, dtype=torch.float64, requires_grad=True)
    mask = masks.padding(torch.tensor([0, 50]))  # sequence 0 may see no key
    for kernel in ["tiled", "reference"]:
        for t in (q, k, v, sinks):
            t.grad = None
        out, lse = attnkit.attention(q, k, v, mask, sinks=sinks, kernel=kernel, return_lse=True)
        assert (out[0] == 0).all()
        assert torch.allclose(lse[0], sinks.detach().view(-1, 1).expand(HQ, 70))  # only the sink is left
        (out * randn(*out.shape, dtype=torch.float64)).sum().backward()
        assert (q.grad[0] == 0).all() and (k.grad[0] == 0).all() and torch.isfinite(sinks.grad).all()
    w = attnkit.attention_weights(q, k, v, mask, sinks=sinks)
    assert (w[0] == 0).all() and (w[1, :, :, :50].sum(-1) < 1).all() and (w[1, :, :, 50:] == 0).all()


def test_masked_pairs_get_no_bias_gradient():
    dense_t = randn(1, 1, 80, 80, dtype=torch.float64, requires_grad=True)
    q, k, v = (randn(1, 2, 80, 8, dtype=torch.float64) for _ in range(3))
    attnkit.attention(q, k, v, masks.causal(), attn_bias=bias.dense(dense_t)).sum().backward()
    assert (dense_t.grad[0, 0].triu(1) == 0).all() and dense_t.grad[0, 0].tril().abs().sum() > 0


# --- parity with the models' definitions -----------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 8, 12, 16, 24, 32, 40])
def test_alibi_slopes_are_bloom_slopes(n):
    assert torch.allclose(bias.alibi_slopes(n).double(), torch.tensor(bloom_slopes(n), dtype=torch.float64), rtol=1e-6)


def test_causal_alibi_equals_bloom_bias_per_key():
    """BLOOM adds slope * key position; with a causal mask that is softmax-equal to -slope * (i - j)."""
    q, k, v = (randn(2, 8, 100, 16, dtype=torch.float64) for _ in range(3))
    slopes = bias.alibi_slopes(8).double()
    bloom = slopes.view(-1, 1, 1) * torch.arange(100, dtype=torch.float64).view(1, 1, -1)  # (H, 1, Lk)
    want = oracle(q, k, v, torch.ones(100, 100, dtype=torch.bool).tril(), add=bloom)
    got = attnkit.attention(q, k, v, masks.causal(), attn_bias=bias.alibi(slopes, causal=True))
    assert (got - want).abs().max() < 1e-12


def test_t5_buckets_match_a_plain_reimplementation():
    rel = torch.arange(-300, 301)
    for nb, md, bidir in [(32, 128, True), (32, 128, False), (16, 64, True), (8, 20, False)]:
        got = bias.relative_buckets(rel, nb, md, bidir)
        want = torch.tensor([t5_bucket(int(r), nb, md, bidir) for r in rel])
        assert torch.equal(got, want), (nb, md, bidir)


# --- MultiHeadAttention, explain, bad input -------------------------------------------------


def test_multihead_attention_softcap_sinks_and_per_call_bias():
    mha = attnkit.MultiHeadAttention(32, 4, softcap=10.0, sinks=True, dtype=torch.float64)
    assert isinstance(mha.sinks, torch.nn.Parameter) and mha.sinks.shape == (4,)
    assert "sinks.weight" not in dict(mha.named_parameters()) and "sinks" in dict(mha.named_parameters())
    with torch.no_grad():
        mha.sinks.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    x = randn(2, 20, 32, dtype=torch.float64)
    slopes = bias.alibi_slopes(4).double()
    out, w = mha(x, mask=masks.causal(), attn_bias=bias.alibi(slopes), need_weights=True)
    q, k, v = mha.project(x)
    want = oracle(
        q,
        k,
        v,
        torch.ones(20, 20, dtype=torch.bool).tril(),
        add=alibi_formula(slopes, 20, 20),
        softcap=10.0,
        sinks=mha.sinks.detach(),
    )
    assert torch.allclose(out, mha.out_proj(mha.merge_heads(want)), atol=1e-12)
    assert torch.allclose(mha(x, mask=masks.causal(), attn_bias=bias.alibi(slopes))[0], out, atol=1e-12)
    assert (w.sum(-1) < 1).all()
    mha(x, mask=masks.causal())[0].pow(2).sum().backward()
    assert mha.sinks.grad is not None and torch.isfinite(mha.sinks.grad).all() and mha.sinks.grad.abs().sum() > 0
    assert "softcap=10, sinks=True" in repr(mha)
    with pytest.raises(ValueError, match="softcap must be a positive number"):
        attnkit.MultiHeadAttention(32, 4, softcap=-1.0)


def test_explain_names_the_modifications():
    q = randn(1, HQ, 300, 16)
    sinks = torch.zeros(HQ)
    plan = attnkit.explain(
        q, q, q, masks.sliding_window(32), attn_bias=bias.alibi(bias.alibi_slopes(HQ)), softcap=50.0, sinks=sinks
    )
    assert plan.kernel in TILED_KERNELS
    assert str(plan).startswith(f"{plan.kernel}: softcap=50, attn_bias=alibi, sinks;")
    assert plan.rejected["sdpa"] == ("no softcap", "no attention sinks (needs the log-sum-exp)")
    assert attnkit.explain(q, q, q, attn_bias=torch.zeros(300, 300)).kernel in TILED_KERNELS


def test_a_float_tensor_is_a_dense_bias():
    q, k, v = (randn(1, 2, 70, 8, dtype=torch.float64) for _ in range(3))
    t = randn(70, 70, dtype=torch.float64)
    a = attnkit.attention(q, k, v, masks.causal(), attn_bias=t)
    b = attnkit.attention(q, k, v, masks.causal(), attn_bias=bias.dense(t))
    assert torch.equal(a, b)


def test_bad_modifications_raise_clear_errors():
    q = randn(2, 4, 10, 8)
    with pytest.raises(ValueError, match="softcap must be a positive finite number"):
        attnkit.attention(q, q, q, softcap=0.0)
    with pytest.raises(ValueError, match="softcap must be a positive finite number"):
        attnkit.attention(q, q, q, softcap=float("inf"))
    with pytest.raises(ValueError, match="softcap must be a positive finite number"):
        attnkit.attention(q, q, q, softcap=True)
    with pytest.raises(ValueError, match=r"sinks must have shape \(Hq,\) = \(4,\)"):
        attnkit.attention(q, q, q, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match="sinks must be a float tensor"):
        attnkit.attention(q, q, q, sinks=[0.0] * 4)
    with pytest.raises(ValueError, match=r"the ALiBi slopes has 3 heads \(shape \(3,\)\) but q has 4 heads"):
        attnkit.attention(q, q, q, attn_bias=bias.alibi(torch.ones(3)))
    with pytest.raises(ValueError, match="the relative position table has 2 heads"):
        attnkit.attention(q, q, q, attn_bias=bias.relative(torch.ones(32, 2)))
    with pytest.raises(ValueError, match=r"table must have shape \(num_buckets=16, num_heads\)"):
        bias.relative(torch.ones(32, 4), num_buckets=16)
    with pytest.raises(ValueError, match=r"does not broadcast to \(B, Hq, Lq, Lk\) = \(2, 4, 10, 10\)"):
        attnkit.attention(q, q, q, attn_bias=bias.dense(torch.ones(3, 10, 10)))
    with pytest.raises(TypeError, match="attn_bias must be an attnkit.bias object"):
        attnkit.attention(q, q, q, attn_bias="alibi")
    with pytest.raises(TypeError, match="the bias function must return a float tensor"):
        attnkit.attention(q, q, q, attn_bias=bias.from_fn(lambda b, h, i, j: i - j))
    with pytest.raises(ValueError, match="the bias function returned shape"):
        attnkit.attention(q, q, q, attn_bias=bias.from_fn(lambda b, h, i, j: torch.zeros(3, 3, 3, 3)))
    with pytest.raises(TypeError, match="slopes must be a float tensor"):
        bias.alibi(torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        bias.alibi_slopes(0)
    with pytest.raises(ValueError, match="attn_bias takes inputs of rank 2 to 4"):
        q5 = randn(1, 2, 4, 10, 8)
        attnkit.attention(q5, q5, q5, attn_bias=bias.alibi(torch.ones(4)))
    with pytest.raises(ValueError, match="kernel='sdpa' cannot run this call: no attention sinks"):
        attnkit.attention(q, q, q, sinks=torch.zeros(4), kernel="sdpa")


# --- memory at long context ---------------------------------------------------------------


@pytest.mark.parametrize("case", ["alibi_causal", "relative_document", "softcap_window", "sinks_window"])
def test_no_lq_by_lk_tensor_at_16384(case):
    length = 16384
    q, k, v = (randn(1, 1, length, 8, requires_grad=True) for _ in range(3))
    learned = torch.tensor([0.01], requires_grad=True)
    mods = {
        "alibi_causal": (masks.causal(), dict(attn_bias=bias.alibi(learned, causal=True))),
        "relative_document": (
            masks.document(torch.arange(length) // (length // 8)),
            dict(attn_bias=bias.relative(torch.randn(32, 1, requires_grad=True))),
        ),
        "softcap_window": (masks.sliding_window(256), dict(softcap=20.0)),
        "sinks_window": (masks.sliding_window(256), dict(sinks=learned)),
    }
    mask, kw = mods[case]
    assert attnkit.explain(q, k, v, mask, **kw).kernel in TILED_KERNELS
    with MaxNumel() as seen:
        out = attnkit.attention(q, k, v, mask, **kw)
        out.sum().backward()
    assert seen.largest <= length * 256, seen.largest  # one row block of keys at most
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_top_level_names():
    for name in [
        "attention",
        "attention_weights",
        "masks",
        "scaled_dot_product_attention",
        "MultiHeadAttention",
        "create_padding_mask",
        "create_causal_mask",
        "visualize_attention",
        "explain",
    ]:
        assert name in attnkit.__all__ and hasattr(attnkit, name)
    for name in ["causal", "sliding_window", "prefix_lm", "document", "padding"]:
        assert callable(getattr(attnkit.masks, name))


# regression: finding F2 of the review of the seams between features
@pytest.mark.parametrize("kernel", ["tiled", "auto", "reference"])
def test_row_whose_kept_keys_all_have_minus_inf_bias_is_empty(kernel):
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


# regression: finding F9 of the review of the seams between features
@pytest.mark.parametrize("kernel", ["tiled", "auto", "reference", "sdpa"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_bias_values_at_hidden_pairs_are_never_read(kernel, poison):
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


def _alibi_problem():
    """12 heads (slopes 2^-0.5, ... that bfloat16 cannot hold) and causal ALiBi without a causal
    mask: keys after a query get a bias of up to +slope * 256, which bfloat16 rounds by whole units."""
    length = 257
    q, k, v = (randn(2, 12, length, 64) for _ in range(3))
    alibi = bias.alibi(bias.alibi_slopes(12), causal=True)
    gold = attnkit.attention(q.double(), k.double(), v.double(), attn_bias=alibi, kernel="reference")
    return (q.bfloat16(), k.bfloat16(), v.bfloat16()), alibi, gold


# regression: finding F7 of the review of the seams between features
@pytest.mark.parametrize("kernel", ["sdpa", "auto"])
def test_bf16_bias_on_sdpa_is_computed_in_float32(kernel):
    (q, k, v), alibi, gold = _alibi_problem()
    out = attnkit.attention(q, k, v, attn_bias=alibi, kernel=kernel)
    tiled = attnkit.attention(q, k, v, attn_bias=alibi, kernel="tiled")
    assert out.dtype == torch.bfloat16
    err, tiled_err = ((x.double() - gold).abs().max().item() for x in (out, tiled))
    assert err <= 2 * tiled_err + rounding_atol(gold, torch.bfloat16)  # was 0.59 (tiled: 0.013)


# regression: finding F7 of the review of the seams between features
def test_bf16_bias_under_torch_compile():
    (q, k, v), alibi, gold = _alibi_problem()
    compiled = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, attn_bias=alibi))
    out = compiled(q, k, v)
    tiled = attnkit.attention(q, k, v, attn_bias=alibi, kernel="tiled")
    err, tiled_err = ((x.double() - gold).abs().max().item() for x in (out, tiled))
    assert err <= 2 * tiled_err + rounding_atol(gold, torch.bfloat16)
