"""TODO"""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch
from _oracle import assert_oracle, gold_and_naive, naive_attention, randn

import attnkit
from attnkit import masks


def test_many_unused_rows_are_zeroed_by_one_copy():
    from attnkit.kernels import reference

    k, v = randn(2, 4, 64, 16), randn(2, 4, 64, 16)
    k[1, :, 20:] = float("nan")
    allowed = masks.padding(torch.tensor([64, 20])).materialize(1, 64)
    k2, v2 = reference.zero_unused_keys(k, v, allowed)
    assert (k2[1, :, 20:] == 0).all() and (v2[1, :, 20:] == 0).all() and torch.equal(k2[0], k[0])


@pytest.mark.parametrize("junk", [0.5, float("nan"), float("inf")])
def test_dense_path_copies_keys_only_when_unused_rows_hold_non_finite_values(junk):
    from attnkit.kernels import reference

    k, v = randn(2, 4, 64, 16), randn(2, 4, 64, 16)
    k[1, :, 60:], v[1, :, 60:] = junk, -junk
    allowed = masks.padding(torch.tensor([64, 60])).materialize(1, 64)  # few unused rows: no copy needed
    k2, v2 = reference.zero_unused_keys(k, v, allowed)
    finite = junk == 0.5
    assert (k2 is k and v2 is v) == finite  # no copy of the cache when nothing needs zeroing
    if not finite:
        assert (k2[1, :, 60:] == 0).all() and (v2[1, :, 60:] == 0).all()
        assert torch.equal(k2[:, :, :60], k[:, :, :60]) and torch.equal(k2[0], k[0])
    q = randn(2, 4, 3, 16)
    out = attnkit.attention(q, k, v, allowed.expand(2, 1, 3, 64), kernel="sdpa")
    gold, naive = gold_and_naive(
        q,
        torch.where(allowed[..., 0, :, None], k, 0.0),
        torch.where(allowed[..., 0, :, None], v, 0.0),
        allowed.expand(2, 1, 3, 64),
    )
    assert_oracle(out, gold, naive)


@pytest.mark.parametrize("lengths", [[1, 1], [1, 5], [1, 64]])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (8, 1)])
def test_one_visible_key_is_exact_on_sdpa(lengths, heads):
    """Where a row sees one key its weight is exactly 1 by the formula: the output is that key's
    value, dq and dk are exactly 0, dv is the sum of dO over the rows (GQA included), one rounding
    (SDPA over one key returned weights of 1 +- 1e-7 and gradients of 1e-6)."""
    hq, hkv = heads
    q, k, v = (randn(2, h, 64, 16, requires_grad=True) for h in (hq, hkv, hkv))
    mask = attnkit.masks.padding(torch.tensor(lengths))
    out = attnkit.attention(q, k, v, mask, kernel="sdpa")
    go = randn(*out.shape)
    out.backward(go)
    first = [b for b, n in enumerate(lengths) if n == 1]
    group = hq // hkv
    for b in first:
        assert torch.equal(out[b], v[b, :, :1].detach().repeat_interleave(group, 0).expand(hq, 64, 16))
        assert not q.grad[b].any() and not k.grad[b].any()
        want = go[b].double().reshape(hkv, group * 64, 16).sum(1)  # (Hkv, Dv)
        torch.testing.assert_close(v.grad[b, :, 0].double(), want, atol=4 * torch.finfo(torch.float32).eps * 64, rtol=0)
        assert not v.grad[b, :, 1:].any()


@pytest.mark.parametrize("lengths", [[0], [0, 0], [0, 3]])
def test_sequences_that_see_no_key_have_zero_gradients_on_sdpa(lengths):
    """A padding mask of length 0 gives 0 and zero gradients for q, k and v, also where every
    sequence sees no key (found by make fuzz: the per-limit calls left an output outside the graph,
    and autograd.grad refused it)."""
    b = len(lengths)
    q, k, v = (randn(b, 2, 3, 8, requires_grad=True) for _ in range(3))
    out = attnkit.attention(q, k, v, attnkit.masks.padding(torch.tensor(lengths)), kernel="sdpa")
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    for i, n in enumerate(lengths):
        if n == 0:
            assert not out[i].any() and not dq[i].any() and not dk[i].any() and not dv[i].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lq", [1, 3, 8, 9])
@pytest.mark.parametrize("mask_name", ["none", "causal_hiding_nothing", "one_limit"])
def test_decoding_over_grouped_heads_runs_one_query_head_per_kv_head(monkeypatch, dtype, lq, mask_name):
    """A call of at most 8 queries over grouped K/V heads that sees every key (or each sequence's
    first n keys) goes to SDPA with a group's query heads as the rows of one head, (B, Hkv, group x
    Lq, D), no enable_gqa; 9 queries keep enable_gqa. Either way the formula's output: the float64
    oracle within 2x the largest of the naive formula's error and SDPA's own on the problem, with
    enable_gqa and in the form it is handed (docs/testing.md), and finite gradients."""
    b, hq, hkv, lk, d = 3, 8, 2, 70, 16
    q = randn(b, hq, lq, d, dtype=dtype, requires_grad=True)
    k, v = (randn(b, hkv, lk, d, dtype=dtype, requires_grad=True) for _ in range(2))
    mask = {
        "none": None,
        "causal_hiding_nothing": masks.causal() if lq == 1 else None,
        "one_limit": masks.padding(torch.tensor([50] * b)),
    }[mask_name]
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q_, k_, v_, *args, **kw):
        seen.append((q_.shape[1], kw.get("enable_gqa", False)))
        return real(q_, k_, v_, *args, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    out = attnkit.attention(q, k, v, mask, kernel="sdpa")
    folded = lq <= 8
    assert seen == [(hkv, False)] if folded else seen == [(hq, True)], seen
    n = 50 if mask_name == "one_limit" else lk
    gold, naive = gold_and_naive(q, k[:, :, :n], v[:, :, :n], None)
    kn, vn = k.detach()[:, :, :n], v.detach()[:, :, :n]
    theirs = real(q.detach(), kn, vn, enable_gqa=True)
    # SDPA on the form it is handed (docs/testing.md): the group's heads as one head's rows, from a reshape here
    as_rows = real(q.detach().reshape(b, hkv, (hq // hkv) * lq, d), kn, vn).reshape(b, hq, lq, d)
    worse = max(naive, theirs, as_rows, key=lambda t: (t.double() - gold).abs().max().item())
    assert_oracle(out, gold, worse, what=f"{mask_name} lq={lq} {dtype}")
    up = torch.randn(out.shape, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), up.to(dtype))
    if dtype != torch.float32:
        assert all(torch.isfinite(g).all() for g in got)
        return

    def grads(fn, dt):
        leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*leaves), leaves, up.to(dt))

    def gqa_sdpa(a, b_, c):
        return real(a, b_[:, :, :n], c[:, :, :n], enable_gqa=True)

    def folded_sdpa(a, b_, c):
        return real(a.reshape(b, hkv, (hq // hkv) * lq, d), b_[:, :, :n], c[:, :, :n]).reshape(b, hq, lq, d)

    def formula(a, b_, c):
        return naive_attention(a, b_[:, :, :n], c[:, :, :n])[0]

    want, low = grads(formula, torch.float64), grads(formula, torch.float32)
    refs = grads(gqa_sdpa, torch.float32), grads(folded_sdpa, torch.float32)
    for name, o, g, *others in zip("qkv", got, want, low, *refs):
        worse = max(others, key=lambda t: (t.double() - g).abs().max().item())
        assert_oracle(o, g, worse, factor=3.0, what=f"d{name} {mask_name} lq={lq}", small=True)
