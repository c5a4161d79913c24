"""attnkit.attention against the float64 oracle, and every edge case of TESTING.md."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import torch.utils._python_dispatch
from _oracle import ALL_KERNELS, DTYPES, assert_oracle, dense_of, gold_and_naive, mask_kinds, naive_attention, randn

import attnkit
from attnkit import masks
from attnkit.kernels import blocks, reference
from attnkit.kernels.runs import math_engine as tiled_math
from attnkit.kernels.runs import tiles
from attnkit.kernels.runs import walk as blocksparse

KERNELS = ["auto", "sdpa", "tiled", "reference"]


def qkv(b=2, hq=4, hkv=None, lq=7, lk=None, d=16, dv=None, dtype=torch.float32, requires_grad=False):
    hkv = hq if hkv is None else hkv
    lk = lq if lk is None else lk
    dv = d if dv is None else dv
    return (
        randn(b, hq, lq, d, dtype=dtype, requires_grad=requires_grad),
        randn(b, hkv, lk, d, dtype=dtype, requires_grad=requires_grad),
        randn(b, hkv, lk, dv, dtype=dtype, requires_grad=requires_grad),
    )


def mask_cases(b, lq, lk):
    """(name, attnkit mask, the same mask as a dense bool tensor built without attnkit)."""
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    p = i + lk - lq
    lengths = torch.randint(1, lk + 1, (b,))
    rand = torch.rand(b, 1, lq, lk) > 0.3
    cases = [
        ("none", None, None),
        ("causal", masks.causal(), j <= p),
        ("causal_top_left", masks.causal(align="top_left"), j <= i),
        ("window", masks.sliding_window(2), (j >= p - 2) & (j <= p)),
        ("prefix", masks.prefix_lm(3), (j < 3) | (j <= p)),
        ("padding", masks.padding(lengths), j[None, None] < lengths[:, None, None, None]),
        ("bool", rand, rand),
        (
            "padding|causal",
            masks.padding(lengths) | masks.causal(),
            (j[None, None] < lengths[:, None, None, None]) | (j <= p),
        ),
    ]
    if lq == lk:
        ids = torch.sort(torch.randint(0, 3, (b, lq)), dim=-1).values
        cases.append(
            (
                "document&causal",
                masks.document(ids) & masks.causal(),
                (ids[:, None, :, None] == ids[:, None, None, :]) & (j <= i),
            )
        )
    return cases


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("lq,lk", [(7, 7), (1, 9), (9, 1), (5, 11), (11, 5), (113, 113)])
def test_every_mask_kind_against_the_oracle(dtype, kernel, lq, lk):
    q, k, v = qkv(lq=lq, lk=lk, dtype=dtype)
    for name, mask, dense in mask_cases(2, lq, lk):
        gold, naive = gold_and_naive(q, k, v, dense)
        out = attnkit.attention(q, k, v, mask, kernel=kernel)
        assert out.dtype == dtype
        assert_oracle(out, gold, naive, what=name)


@pytest.mark.parametrize("d,dv", [(8, 8), (40, 40), (64, 64), (80, 80), (128, 128), (64, 24), (8, 72)])
@pytest.mark.parametrize("kernel", KERNELS)
def test_head_dims(d, dv, kernel):
    q, k, v = qkv(lq=9, lk=13, d=d, dv=dv)
    gold, naive = gold_and_naive(q, k, v)
    assert_oracle(attnkit.attention(q, k, v, kernel=kernel), gold, naive)


@pytest.mark.parametrize("length", [1, 7, 113, 1023, 1025])
def test_awkward_lengths(length):
    q, k, v = qkv(b=1, hq=2, lq=length, d=32)
    gold, naive = gold_and_naive(q, k, v, torch.ones(length, length, dtype=torch.bool).tril())
    assert_oracle(attnkit.attention(q, k, v, masks.causal()), gold, naive)


def test_float64_matches_the_reference_to_1e12():
    q, k, v = qkv(dtype=torch.float64, lq=33, lk=40)
    gold, _ = gold_and_naive(q, k, v, (torch.arange(40) < 35).expand(33, 40))
    for kernel in KERNELS:
        out = attnkit.attention(q, k, v, masks.padding(torch.tensor([35, 35])), kernel=kernel)
        assert (out - gold).abs().max() <= 1e-12


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_fully_masked_rows_give_zeros_and_zero_gradients(dtype, kernel):
    q, k, v = qkv(lq=6, lk=6, dtype=dtype, requires_grad=True)
    mask = torch.rand(2, 4, 6, 6) > 0.4
    mask[:, :, 2] = False  # row 2 sees nothing
    mask[1, 3] = False  # a whole head sees nothing
    out = attnkit.attention(q, k, v, mask, kernel=kernel)
    assert torch.isfinite(out).all()
    assert (out[:, :, 2] == 0).all() and (out[1, 3] == 0).all()
    out.backward(torch.randn_like(out))
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, 2] == 0).all() and (q.grad[1, 3] == 0).all()
    assert (k.grad[1, 3] == 0).all() and (v.grad[1, 3] == 0).all()
    weights = attnkit.attention_weights(q, k, v, mask)
    assert (weights[:, :, 2] == 0).all() and torch.isfinite(weights).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("poison", [float("nan"), 1e30, float("inf")])
def test_poison_in_masked_keys_does_not_leak(dtype, kernel, poison):
    q, k, v = qkv(lq=5, lk=9, dtype=dtype)
    lengths = torch.tensor([6, 9])
    clean = attnkit.attention(q, k, v, masks.padding(lengths), kernel=kernel)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 6:] = poison
    v2[0, :, 6:] = poison
    poisoned = attnkit.attention(q, k2, v2, masks.padding(lengths), kernel=kernel)
    assert torch.equal(clean, poisoned)  # the same computation: bit for bit
    dense = masks.padding(lengths).materialize(5, 9)
    # a dense mask may take another path (other rounding), never NaN
    gold, naive = gold_and_naive(q, k, v, dense)
    assert_oracle(attnkit.attention(q, k2, v2, dense, kernel=kernel), gold, naive)


def test_poison_in_masked_keys_does_not_reach_gradients():
    q, k, v = qkv(lq=5, lk=9, requires_grad=False)
    k[0, :, 6:] = float("nan")
    v[0, :, 6:] = float("nan")
    for t in (q, k, v):
        t.requires_grad_(True)
    for kernel in KERNELS:
        out = attnkit.attention(q, k, v, masks.padding(torch.tensor([6, 9])), kernel=kernel)
        q.grad = k.grad = v.grad = None
        out.sum().backward()
        assert torch.isfinite(q.grad).all()
        assert (k.grad[0, :, 6:] == 0).all() and (v.grad[0, :, 6:] == 0).all()


@pytest.mark.parametrize("lq,lk", [(3, 8), (8, 3), (1, 6)])
def test_causal_alignment_against_hand_built_masks(lq, lk):
    q, k, v = qkv(lq=lq, lk=lk, dtype=torch.float64)
    bottom_right = torch.tensor([[j <= i + lk - lq for j in range(lk)] for i in range(lq)])
    top_left = torch.tensor([[j <= i for j in range(lk)] for i in range(lq)])
    for kernel in KERNELS:
        got = attnkit.attention(q, k, v, masks.causal(), kernel=kernel)
        assert torch.allclose(got, naive_attention(q, k, v, bottom_right)[0], atol=1e-12)
        got = attnkit.attention(q, k, v, masks.causal(align="top_left"), kernel=kernel)
        assert torch.allclose(got, naive_attention(q, k, v, top_left)[0], atol=1e-12)


def test_single_query_decoding_sees_every_cached_key():
    q, k, v = qkv(lq=1, lk=10, dtype=torch.float64)
    assert torch.allclose(attnkit.attention(q, k, v, masks.causal()), naive_attention(q, k, v)[0], atol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS)
def test_empty_keys_give_zeros_of_the_right_shape(kernel):
    q, k, v = qkv(lq=4, lk=0, d=8, dv=5, requires_grad=True)
    out = attnkit.attention(q, k, v, kernel=kernel)
    assert out.shape == (2, 4, 4, 5) and (out == 0).all()
    out.sum().backward()
    assert (q.grad == 0).all()
    assert attnkit.attention_weights(q, k, v).shape == (2, 4, 4, 0)
    empty_q = attnkit.attention(q[:, :, :0], k, v, kernel=kernel)
    assert empty_q.shape == (2, 4, 0, 5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1), (6, 3)])
def test_gqa_equals_repeating_kv_heads(kernel, hq, hkv):
    q, k, v = qkv(hq=hq, hkv=hkv, lq=7, lk=9)
    group = hq // hkv
    want = attnkit.attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), masks.causal(), kernel=kernel
    )
    got = attnkit.attention(q, k, v, masks.causal(), kernel=kernel)
    assert torch.allclose(got, want, atol=1e-6)
    head_mask = torch.rand(2, hq, 7, 9) > 0.5
    want = attnkit.attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), head_mask, kernel=kernel)
    assert torch.allclose(attnkit.attention(q, k, v, head_mask, kernel=kernel), want, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
def test_non_contiguous_inputs_equal_contiguous(kernel):
    base = randn(2, 7, 4, 3, 16)  # (B, L, H, 3, D)
    q, k, v = (base[..., i, :].transpose(1, 2) for i in range(3))  # (B, H, L, D) views
    assert not q.is_contiguous()
    mask = (torch.rand(2, 1, 7, 1) > 0.3).expand(2, 4, 7, 7)  # expanded mask
    # strided and contiguous inputs take different BLAS paths: equal within rounding, not bit for bit
    gold, naive = gold_and_naive(q.contiguous(), k.contiguous(), v.contiguous(), mask.contiguous())
    assert_oracle(attnkit.attention(q, k, v, mask, kernel=kernel), gold, naive)
    assert_oracle(
        attnkit.attention(q.contiguous(), k.contiguous(), v.contiguous(), mask.contiguous(), kernel=kernel), gold, naive
    )


@pytest.mark.parametrize(
    "shape", [(7, 9), (1, 9), (2, 1, 1, 9), (1, 4, 7, 9), (2, 4, 7, 9), (2, 1, 7, 9), (4, 1, 9), (1, 1)]
)
@pytest.mark.parametrize("kernel", KERNELS)
def test_masks_of_every_broadcast_shape(shape, kernel):
    q, k, v = qkv(lq=7, lk=9, dtype=torch.float64)
    mask = torch.rand(shape) > 0.3
    dense = mask.expand(2, 4, 7, 9).contiguous()
    want = naive_attention(q, k, v, dense)[0]
    assert torch.allclose(attnkit.attention(q, k, v, mask, kernel=kernel), want, atol=1e-12)


@pytest.mark.parametrize("kernel", ["auto", "sdpa", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_additive_float_mask(kernel, dtype):
    q, k, v = qkv(lq=5, lk=6, dtype=dtype)
    bias = torch.randn(2, 1, 5, 6, dtype=dtype)
    bias[0, 0, 1] = float("-inf")
    bias[1, 0, :, 2] = float("-inf")
    gold, naive = gold_and_naive(q, k, v, bias)
    out = attnkit.attention(q, k, v, bias, kernel=kernel)
    assert_oracle(out, gold, naive)
    assert (out[0, :, 1] == 0).all()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_logits_do_not_overflow(kernel, dtype):
    q, k, v = qkv(lq=9, lk=9, dtype=torch.float32)
    q, k = (q * 100).to(dtype), (k * 100).to(dtype)
    v = v.to(dtype)
    gold, naive = gold_and_naive(q, k, v, torch.ones(9, 9, dtype=torch.bool).tril())
    assert_oracle(attnkit.attention(q, k, v, masks.causal(), kernel=kernel), gold, naive)


@pytest.mark.parametrize("kernel", KERNELS)
def test_bf16_inputs_near_1e5(kernel):
    q, k, v = (t.to(torch.bfloat16) for t in qkv(lq=6, lk=6, dtype=torch.float32))
    q, k, v = q * 1e5, k * 1e5, v * 1e5
    out = attnkit.attention(q, k, v, masks.causal(), kernel=kernel)
    assert torch.isfinite(out).all()
    gold, naive = gold_and_naive(q, k, v, torch.ones(6, 6, dtype=torch.bool).tril())
    assert_oracle(out, gold, naive)


@pytest.mark.parametrize("kernel", KERNELS)
def test_fp16_large_logits_stay_finite(kernel):
    q, k, v = qkv(lq=9, lk=9, d=64, dtype=torch.float32)
    q, k, v = (q * 100).half(), (k * 100).half(), v.half()
    out = attnkit.attention(q, k, v, masks.causal(), kernel=kernel)
    assert torch.isfinite(out).all()
    gold, _ = gold_and_naive(q, k, v, torch.ones(9, 9, dtype=torch.bool).tril())
    # the naive fp16 formula overflows here (scores > 65504), so bound by fp16 rounding of v
    assert (out.double() - gold).abs().max() <= 4 * torch.finfo(torch.float16).eps * v.abs().max()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("scale", [0.0, -0.7, 1e-8, 3.0])
def test_scale_is_honoured(kernel, scale):
    q, k, v = qkv(lq=5, lk=7, dtype=torch.float64)
    want = naive_attention(q, k, v, scale=scale)[0]
    got = attnkit.attention(q, k, v, scale=scale, kernel=kernel)
    assert torch.allclose(got, want, atol=1e-12)
    if scale == 0.0:
        assert torch.allclose(got, v.mean(dim=-2, keepdim=True).expand_as(got), atol=1e-12)


@pytest.mark.parametrize("rank", [2, 3, 5])
@pytest.mark.parametrize("kernel", KERNELS)
def test_other_ranks(rank, kernel):
    if rank == 5 and kernel == "tiled":
        pytest.skip("the tiled kernel takes ranks 2 to 4 (covered by test_tiled_refuses_what_it_cannot_run)")
    shape = {2: (), 3: (4,), 5: (2, 3, 4)}[rank]
    q, k, v = (
        randn(*shape, 6, 8, dtype=torch.float64),
        randn(*shape, 5, 8, dtype=torch.float64),
        randn(*shape, 5, 3, dtype=torch.float64),
    )
    mask = torch.rand(6, 5) > 0.3
    want = naive_attention(q, k, v, mask)[0]
    assert torch.allclose(attnkit.attention(q, k, v, mask, kernel=kernel), want, atol=1e-12)
    assert torch.allclose(
        attnkit.attention(q, k, v, masks.causal(), kernel=kernel),
        naive_attention(q, k, v, masks.causal().materialize(6, 5)[0, 0])[0],
        atol=1e-12,
    )


@pytest.mark.parametrize("kernel", KERNELS)
def test_same_inputs_twice_are_bit_identical(kernel):
    q, k, v = qkv(lq=33, lk=40)
    mask = masks.padding(torch.tensor([20, 40])) & masks.causal()
    assert torch.equal(attnkit.attention(q, k, v, mask, kernel=kernel), attnkit.attention(q, k, v, mask, kernel=kernel))


def test_attention_weights_are_probabilities():
    q, k, v = qkv(lq=6, lk=8, dtype=torch.float64)
    mask = masks.sliding_window(2)
    w = attnkit.attention_weights(q, k, v, mask)
    want = naive_attention(q, k, v, mask.materialize(6, 8))[1]
    assert w.shape == (2, 4, 6, 8)
    assert torch.allclose(w, want, atol=1e-12)
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 6, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_weights_in_low_precision(dtype):
    q, k, v = qkv(lq=6, lk=8, dtype=dtype)
    w = attnkit.attention_weights(q, k, v, masks.causal())
    assert w.dtype == dtype
    gold = naive_attention(q.double(), k.double(), v.double(), masks.causal().materialize(6, 8))[1]
    naive = naive_attention(q, k, v, masks.causal().materialize(6, 8))[1]
    assert_oracle(w, gold, naive)


def test_parity_with_torch_sdpa():
    q, k, v = qkv(lq=17, lk=23)
    mask = torch.rand(2, 4, 17, 23) > 0.2
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(attnkit.attention(q, k, v, mask, kernel="reference"), want, atol=1e-5)
    want = F.scaled_dot_product_attention(q, k, v[..., :23, :], is_causal=True)
    assert torch.allclose(
        attnkit.attention(q, k, v, masks.causal(align="top_left"), kernel="reference"), want, atol=1e-5
    )


# --- dropout ---------------------------------------------------------------------------


def test_dropout_kept_fraction_is_binomial():
    p = 0.3
    q, k, v = qkv(b=4, hq=4, lq=64, lk=64)
    v = torch.eye(64).expand(4, 4, 64, 64)  # out == dropped weights
    w = attnkit.attention_weights(q, k, v)
    out = attnkit.attention(q, k, v, dropout_p=p)
    kept = (out != 0).double().mean().item()
    n = out.numel()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(kept - (1 - p)) < 6 * sigma
    nonzero = out != 0
    assert torch.allclose(out[nonzero], (w / (1 - p))[nonzero], rtol=1e-5)


@pytest.mark.parametrize("kernel", ["auto", "tiled", "reference"])
def test_dropout_is_reproducible_and_equals_the_reference_with_its_mask(kernel):
    q, k, v = qkv(hq=4, hkv=2, lq=9, lk=11, dtype=torch.float64, requires_grad=True)
    mask = masks.causal()
    torch.manual_seed(123)
    out = attnkit.attention(q, k, v, mask, dropout_p=0.25, kernel=kernel)
    torch.manual_seed(123)
    again = attnkit.attention(q, k, v, mask, dropout_p=0.25, kernel=kernel)
    assert torch.equal(out, again)
    torch.manual_seed(123)
    if kernel == "reference":
        keep = reference.draw_dropout_mask((2, 4, 9, 11), 0.25, q.device)
    else:
        keep = tiled_keep_mask(q, k, mask, dropout_p=0.25, seed=blocksparse.draw_seed())
    dense = mask.materialize(9, 11)
    keep = keep | ~dense  # outside the mask the weight is 0 either way
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    _, w = naive_attention(q, kk, vv, dense)
    want = (w * keep / 0.75) @ vv
    assert torch.allclose(out, want, atol=1e-12)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(want, (q, k, v), grad)
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, atol=1e-12)


def tiled_keep_mask(q, k, mask, *, dropout_p, seed):
    """The full (B, Hq, Lq, Lk) keep-mask the tiled kernel draws with this seed (O(L^2))."""
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[-2]
    prepared = attnkit.prepare(mask, lq, lk)
    call = tiles.TileCall(prepared, 1.0, dropout_p, seed, "math")
    keep = torch.zeros(b, hq, lq, lk, dtype=torch.bool)
    assert len(blocks.groups(prepared)) == 1
    for row in blocks.groups(prepared)[0].rows:
        for run in row.runs:
            shape = (b, hkv, (hq // hkv) * (row.q1 - row.q0), run.k1 - run.k0)
            tile = tiled_math.dropout_keep_mask(call, 0, row, run, shape, q.device)
            keep[:, :, row.q0 : row.q1, run.k0 : run.k1] = tiles.unfold(tile, hq)
    return keep


def test_dropout_zero_is_deterministic_and_does_not_touch_the_generator():
    q, k, v = qkv()
    state = torch.get_rng_state()
    attnkit.attention(q, k, v, dropout_p=0.0)
    assert torch.equal(state, torch.get_rng_state())


def test_tiled_refuses_what_it_cannot_run():
    q, k, v = qkv(lq=4, lk=4)
    with pytest.raises(
        ValueError, match="kernel='tiled' cannot run this call: none of its kernels can.*native: no additive float mask"
    ):
        attnkit.attention(q, k, v, torch.zeros(4, 4), kernel="tiled")
    q5 = q[None]
    with pytest.raises(ValueError, match="takes inputs of rank 2 to 4, not 5"):
        attnkit.attention(q5, k[None], v[None], kernel="tiled")


@pytest.mark.parametrize("name", list(mask_kinds()))
def test_every_mask_kind_works_under_inference_mode(name):
    q, k, v = randn(2, 2, 150, 16), randn(2, 2, 150, 16), randn(2, 2, 150, 16)
    with torch.inference_mode():
        mask = mask_kinds()[name]  # built inside, as sentence-transformers' encode does
        gold, naive = gold_and_naive(q, k, v, dense_of(mask, 150, 150))
        for kernel in ALL_KERNELS:
            assert_oracle(attnkit.attention(q, k, v, mask, kernel=kernel), gold, naive, what=f"{name} {kernel}")
            assert_oracle(attnkit.attention(q, k, v, mask, kernel=kernel), gold, naive, what=f"{name} {kernel} again")
        prepared = attnkit.prepare(mask, 150, 150)
        assert_oracle(attnkit.attention(q, k, v, prepared), gold, naive)
    with torch.no_grad():
        assert_oracle(attnkit.attention(q, k, v, mask), gold, naive)


def test_modules_under_inference_mode():
    mha = attnkit.MultiHeadAttention(32, 4)
    x = randn(2, 300, 32)
    want = mha(x, mask=masks.padding(torch.tensor([100, 300])))[0]
    with torch.inference_mode():
        got = mha(x, mask=masks.padding(torch.tensor([100, 300])))[0]
        cache = attnkit.KVCache(2, 4, 16, 8)
        mha(randn(2, 3, 32), mask=masks.causal(), cache=cache)
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("kernel", ["auto", "tiled", "reference"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_return_lse_values(kernel, dtype):
    q, k, v = randn(2, 4, 70, 16, dtype=dtype), randn(2, 2, 90, 16, dtype=dtype), randn(2, 2, 90, 16, dtype=dtype)
    mask = masks.sliding_window(7) & masks.padding(torch.tensor([90, 40]))
    dense = mask.materialize(70, 90)
    dense[:, :, 3] = False  # a fully masked row
    out, lse = attnkit.attention(q, k, v, dense, kernel=kernel, return_lse=True)
    assert lse.shape == (2, 4, 70) and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    kk = k.double().repeat_interleave(2, 1)
    scores = (q.double() @ kk.transpose(-1, -2) * 16**-0.5).masked_fill(~dense, float("-inf"))
    want = torch.logsumexp(scores, -1)
    assert (lse[:, :, 3] == float("-inf")).all() and (out[:, :, 3] == 0).all()
    finite = torch.isfinite(want)
    tol = 1e-12 if dtype == torch.float64 else 1e-4 if dtype == torch.float32 else 0.1
    assert (lse[finite].double() - want[finite]).abs().max() < tol


@pytest.mark.parametrize("kernel", ["tiled", "reference"])
def test_return_lse_gradcheck_through_both_outputs(kernel):
    mask = masks.prefix_lm(2) | masks.sliding_window(2)
    dense = mask.materialize(11, 11).clone()
    dense[:, :, 4] = False
    q, k, v = (randn(1, 2, 11, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    p = attnkit.prepare(dense, 11, 11, block_size=(4, 4))
    w = randn(1, 2, 11, dtype=torch.float64)

    def f(q, k, v):
        out, lse = attnkit.attention(q, k, v, p, kernel=kernel, return_lse=True)
        return out, torch.where(torch.isfinite(lse), lse, 0.0) * w

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_lse_merges_attention_over_split_keys():
    q, k, v = (
        randn(1, 2, 50, 8, dtype=torch.float64),
        randn(1, 2, 80, 8, dtype=torch.float64),
        randn(1, 2, 80, 8, dtype=torch.float64),
    )
    o1, l1 = attnkit.attention(q, k[:, :, :30], v[:, :, :30], return_lse=True)
    o2, l2 = attnkit.attention(q, k[:, :, 30:], v[:, :, 30:], return_lse=True)
    total = torch.logaddexp(l1, l2)
    merged = torch.exp(l1 - total)[..., None] * o1 + torch.exp(l2 - total)[..., None] * o2
    assert (merged - attnkit.attention(q, k, v)).abs().max() < 1e-12


def test_negative_or_zero_scale_with_causal_masks_is_not_nan():
    q, k, v = (
        randn(1, 2, 6, 8, dtype=torch.float64),
        randn(1, 2, 6, 8, dtype=torch.float64),
        randn(1, 2, 6, 8, dtype=torch.float64),
    )
    for scale in (0.0, -0.5):
        want = naive_attention(q, k, v, masks.causal().materialize(6, 6), scale=scale)[0]
        for kernel in ALL_KERNELS:
            got = attnkit.attention(q, k, v, masks.causal(), scale=scale, kernel=kernel)
            assert (got - want).abs().max() < 1e-12, (scale, kernel)


# regression: a finding of the adversarial review of the inputs (hardening)
@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_causal_with_zero_or_negative_scale_is_not_nan(scale):
    q, k, v = (randn(1, 2, 9, 8, dtype=torch.float64) for _ in range(3))
    want = naive_attention(q, k, v, torch.ones(9, 9, dtype=torch.bool).tril(), scale=scale)[0]
    for kernel in KERNELS:
        assert torch.allclose(attnkit.attention(q, k, v, masks.causal(), scale=scale, kernel=kernel), want, atol=1e-12)


# regression: a finding of the adversarial review of the inputs (hardening)
@pytest.mark.parametrize("kernel", KERNELS)
def test_nan_in_keys_and_values_no_query_attends_never_reaches_the_output(kernel):
    """What holds on every kernel: K/V rows hidden from every query are never read (or zeroed)."""
    q, k, v = (randn(2, 2, 150, 8, dtype=torch.float64) for _ in range(3))
    lengths = torch.tensor([150, 90])
    k[1, :, 90:] = float("nan")
    v[1, :, 90:] = float("inf")
    out = attnkit.attention(q, k, v, masks.padding(lengths) & masks.causal(), kernel=kernel)
    assert torch.isfinite(out).all()
    clean_k, clean_v = k.clone(), v.clone()
    clean_k[1, :, 90:], clean_v[1, :, 90:] = 0.0, 0.0
    assert torch.allclose(
        out,
        attnkit.attention(q, clean_k, clean_v, masks.padding(lengths) & masks.causal(), kernel="reference"),
        atol=1e-12,
    )


# regression: a finding of the adversarial review of the inputs (hardening)
@pytest.mark.parametrize("kernel", KERNELS)
def test_fully_masked_rows_give_zero_and_zero_gradients_whatever_their_query_holds(kernel):
    length = 200
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    allowed[50:60] = False  # ten queries that may see nothing, inside partial tiles
    q = randn(1, 2, length, 8)
    q[:, :, 50:60] = float("nan")
    q.requires_grad_()
    k, v = (randn(1, 2, length, 8, requires_grad=True) for _ in range(2))
    out = attnkit.attention(q, k, v, allowed, kernel=kernel)
    assert (out[:, :, 50:60] == 0).all() and torch.isfinite(out).all()
    out.sum().backward()
    assert (q.grad[:, :, 50:60] == 0).all()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# regression: finding F1 of the review of the seams between features
@pytest.mark.parametrize("kernel", ["tiled", "auto"])
@pytest.mark.parametrize("layout", ["transposed", "strided"])
@pytest.mark.parametrize("mask", ["window", "document", "padding"])
def test_strided_last_dim(kernel, layout, mask):
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


# regression: finding F23 of the review of the seams between features
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_output_gradient_reaches_the_returned_weights(dtype, with_sinks):
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
