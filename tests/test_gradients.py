"""Gradients: gradcheck in float64, and every kernel against the float64 oracle (3x rule)."""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch
from _oracle import DTYPES, naive_attention, randn, rounding_atol

import attnkit
from attnkit import masks


def small(lq=4, lk=5, hq=2, hkv=2, d=3, dv=2):
    return (
        randn(1, hq, lq, d, dtype=torch.float64, requires_grad=True),
        randn(1, hkv, lk, d, dtype=torch.float64, requires_grad=True),
        randn(1, hkv, lk, dv, dtype=torch.float64, requires_grad=True),
    )


def fully_masked_row_mask():
    m = torch.rand(1, 2, 4, 5) > 0.4
    m[..., 1, :] = False
    return m


@pytest.mark.parametrize("kernel", ["auto", "reference"])
@pytest.mark.parametrize(
    "make_mask",
    [lambda: None, masks.causal, lambda: masks.sliding_window(1) | masks.prefix_lm(1), fully_masked_row_mask],
    ids=["none", "causal", "window|prefix", "fully-masked-row"],
)
def test_gradcheck_attention(kernel, make_mask):
    q, k, v = small()
    mask = make_mask()
    assert torch.autograd.gradcheck(lambda q, k, v: attnkit.attention(q, k, v, mask, kernel=kernel), (q, k, v))


def test_gradcheck_gqa_and_weights():
    q, k, v = small(hq=4, hkv=2)
    assert torch.autograd.gradcheck(lambda q, k, v: attnkit.attention(q, k, v, masks.causal()), (q, k, v))
    mask = fully_masked_row_mask()[:, :1]
    assert torch.autograd.gradcheck(lambda q, k, v: attnkit.attention_weights(q, k, v, mask), (q, k, v))


def test_gradcheck_module():
    mha = attnkit.MultiHeadAttention(8, 2, num_kv_heads=1, kdim=6, vdim=6).double()
    x = randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    mem = randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, m: mha(x, m, m)[0], (x, mem))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", ["auto", "sdpa", "reference"])
def test_kernel_gradients_against_the_oracle(dtype, kernel):
    q64 = randn(2, 4, 13, 16, dtype=torch.float64)
    k64 = randn(2, 2, 17, 16, dtype=torch.float64)
    v64 = randn(2, 2, 17, 16, dtype=torch.float64)
    grad_out = randn(2, 4, 13, 16, dtype=torch.float64)
    mask = masks.padding(torch.tensor([9, 17])) & masks.causal()
    dense = mask.materialize(13, 17)

    def grads(fn, dt):
        q, k, v = (t.to(dt).detach().requires_grad_(True) for t in (q64, k64, v64))
        fn(q, k, v).backward(grad_out.to(dt))
        return [t.grad for t in (q, k, v)]

    gold = grads(lambda q, k, v: naive_attention(q, k, v, dense)[0], torch.float64)
    naive = grads(lambda q, k, v: naive_attention(q, k, v, dense)[0], dtype)
    got = grads(lambda q, k, v: attnkit.attention(q, k, v, mask, kernel=kernel), dtype)
    for name, g, n, o in zip("qkv", gold, naive, got):
        assert torch.isfinite(o).all(), name
        err = (o.double() - g).abs().max().item()
        if dtype == torch.float64:
            assert err <= 1e-12, name
        else:
            bound = 3 * (n.double() - g).abs().max().item() + rounding_atol(g, dtype)
            assert err <= bound, f"d{name}: {err:.3e} > {bound:.3e}"


def test_double_backward_through_the_tiled_kernel_is_refused_clearly():
    q, k, v = (randn(1, 1, 300, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = attnkit.attention(q, k, v, masks.sliding_window(32), kernel="tiled")
    with pytest.raises(ValueError, match="first derivatives only.*kernel='reference'"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    ref = attnkit.attention(q, k, v, masks.sliding_window(32), kernel="reference")
    (g,) = torch.autograd.grad(ref.sum(), q, create_graph=True)
    assert g.requires_grad


# regression: a finding of the adversarial review of the inputs (hardening)
def test_double_backward_through_the_tiled_kernel_raises_a_clear_error():
    q, k, v = (randn(1, 1, 80, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = attnkit.attention(q, k, v, masks.sliding_window(8), kernel="tiled")
    with pytest.raises(ValueError, match="first derivatives only.*kernel='reference'"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    out = attnkit.attention(q, k, v, masks.sliding_window(8), kernel="reference")  # the one that can
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    g.square().sum().backward()
    assert torch.isfinite(k.grad).all()


# regression: finding F14 of the review of the seams between features
@pytest.mark.parametrize("kernel", ["auto", "sdpa", "tiled"])
def test_double_backward_gives_one_clear_error(kernel):
    q = randn(1, 2, 64, 8, requires_grad=True)
    k, v = randn(1, 2, 64, 8), randn(1, 2, 64, 8)
    out = attnkit.attention(q, k, v, masks.causal(), kernel=kernel)
    with pytest.raises(ValueError, match="computes first derivatives only.*kernel='reference'"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    out = attnkit.attention(q, k, v, masks.causal(), kernel=kernel)  # first derivatives still work
    (g,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(g).all()


# regression: finding F14 of the review of the seams between features
def test_double_backward_through_the_reference_kernel():
    q = randn(1, 1, 5, 4, dtype=torch.float64, requires_grad=True)
    k, v = randn(1, 1, 5, 4, dtype=torch.float64), randn(1, 1, 5, 4, dtype=torch.float64)
    assert torch.autograd.gradgradcheck(lambda q: attnkit.attention(q, k, v, masks.causal(), kernel="reference"), (q,))
