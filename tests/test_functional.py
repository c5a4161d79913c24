"""attnkit.attention against the float64 oracle, and every edge case of TESTING.md."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, assert_oracle, gold_and_naive, naive_attention, randn

import attnkit
from attnkit import masks
from attnkit.kernels import reference, tiled, tiles

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
        keep = tiled_keep_mask(q, k, mask, dropout_p=0.25, seed=tiled.draw_seed())
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
    call = tiles.TileCall(prepared, 1.0, dropout_p, seed, False)
    keep = torch.zeros(b, hq, lq, lk, dtype=torch.bool)
    assert len(prepared.groups) == 1
    for row in prepared.groups[0].rows:
        for run in row.runs:
            shape = (b, hkv, (hq // hkv) * (row.q1 - row.q0), run.k1 - run.k0)
            tile = tiled.dropout_keep_mask(call, 0, row, run, shape, q.device)
            keep[:, :, row.q0 : row.q1, run.k0 : run.k1] = tiles.unfold(tile, hq)
    return keep


def test_dropout_zero_is_deterministic_and_does_not_touch_the_generator():
    q, k, v = qkv()
    state = torch.get_rng_state()
    attnkit.attention(q, k, v, dropout_p=0.0)
    assert torch.equal(state, torch.get_rng_state())


def test_tiled_refuses_what_it_cannot_run():
    q, k, v = qkv(lq=4, lk=4)
    with pytest.raises(ValueError, match="kernel='tiled' cannot run this call: no additive float mask"):
        attnkit.attention(q, k, v, torch.zeros(4, 4), kernel="tiled")
    q5 = q[None]
    with pytest.raises(ValueError, match="takes inputs of rank 2 to 4, not 5"):
        attnkit.attention(q5, k[None], v[None], kernel="tiled")
