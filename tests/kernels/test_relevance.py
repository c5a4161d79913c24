"""The reduction of the weights for attribution (``Kernel.relevance``, chosen by ``registry.relevance``)
on the native engine and the math kernel against the float64 formulas written here from dense
weights: the gradient rule ``out[b, :, j] = sum_i r[b, :, i] sum_h w_h max(0, (dO_h[i] . v_h[j]) A_h[i, j])``
and, without ``d_out``, rollout's ``sum_i r[b, :, i] sum_h w_h A_h[i, j]``."""

from __future__ import annotations

import pytest
import torch
from _oracle import assert_oracle

import attnkit
from attnkit import bias, functional, masks
from attnkit.kernels import registry
from attnkit.kernels.contract import RelevanceRequest

L, HQ, HKV, D = 150, 4, 2, 16


def _ids(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5, (2, L), generator=g).sort(-1).values


CASES = {
    "causal (GQA)": (masks.causal(), {}),
    "document & causal": (masks.document(_ids(1)) & masks.causal(), {}),
    "padding, rows with no key": (masks.causal() & masks.padding([0, 90]), {}),
    "window": (masks.sliding_window(23), {}),
    "alibi & softcap": (masks.causal(), {"attn_bias": bias.alibi(bias.alibi_slopes(HQ)), "softcap": 6.0}),
    "sinks": (masks.causal(), {"sinks": torch.randn(HQ)}),
    "no mask, another scale": (None, {"scale": 0.3}),
    # logits near 100 (a trained model's): a float32 lse of 80 is off by up to 4e-6, the same for its whole row
    "large logits": (masks.causal(), {"scale": 2.0}),
    "large logits & sinks": (masks.causal(), {"scale": 2.0, "sinks": torch.randn(HQ) * 20}),
}


def _formula(q, k, v, mask, r, d_out, head_weights, dtype=torch.float64, **mods):
    w = attnkit.attention_weights(q.to(dtype), k.to(dtype), v.to(dtype), mask, **mods)  # (B, H, Lq, Lk)
    if d_out is None:
        m = w
    else:
        vv = v.to(dtype).repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        m = (d_out.to(dtype) @ vv.transpose(-2, -1) * w).clamp_min(0)
    return torch.einsum("bri,bhij,h->brj", r.to(dtype), m, head_weights.to(dtype))


def _problem(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, HQ, L, D, generator=g, dtype=dtype)
    k = torch.randn(2, HKV, L, D, generator=g, dtype=dtype)
    v = torch.randn(2, HKV, L, D, generator=g, dtype=dtype)
    d_out = torch.randn(2, HQ, L, D, generator=g, dtype=dtype)
    r = torch.rand(2, 2, L, generator=g, dtype=dtype)
    r[:, :, 40:110] = 0  # rows no vector weights: skipped
    return q, k, v, d_out, r


@pytest.mark.parametrize("rule", ["grad", "weights"])
@pytest.mark.parametrize("kernel", ["native", "math"])
@pytest.mark.parametrize("name", list(CASES))
def test_relevance_equals_the_formula(name, kernel, rule):
    from attnkit.kernels.native import build as native_build

    if kernel == "native" and not native_build.available():
        pytest.skip(native_build.status()[1])
    mask, mods = CASES[name]
    q, k, v, d_out, r = _problem(3)
    d_out = d_out if rule == "grad" else None
    head_weights = torch.tensor([0.5, 0.0, 0.5, 0.0])  # heads 0 and 2 averaged
    _, lse = attnkit.attention(q, k, v, mask, return_lse=True, **mods)
    call = functional.stats_call(q, k, v, mask, **mods)
    with attnkit.use_kernels(kernel):
        assert registry.choose_relevance(call).chosen.name == kernel
        got = registry.relevance(call, RelevanceRequest(lse, r, d_out, head_weights))
    gold = _formula(q, k, v, mask, r, d_out, head_weights, **mods)
    naive = _formula(q, k, v, mask, r, d_out, head_weights, torch.float32, **mods)
    assert got.shape == (2, 2, L) and got.dtype == torch.float32
    assert_oracle(got, gold, naive, what=f"{kernel} {name} {rule}")
    if name.startswith("padding"):
        assert (got[0] == 0).all() and (got[1, :, 90:] == 0).all()  # no key seen, keys hidden: nothing


def test_float64_on_the_math_kernel_and_the_choice():
    q, k, v, d_out, r = _problem(5, torch.float64)
    mask = masks.sliding_window(31) & masks.causal()
    _, lse = attnkit.attention(q, k, v, mask, return_lse=True)
    call = functional.stats_call(q, k, v, mask)
    assert registry.choose_relevance(call).chosen.name == "math"  # the engine takes no float64
    got = registry.relevance(call, RelevanceRequest(lse, r, d_out, torch.full((HQ,), 0.25)))
    gold = _formula(q, k, v, mask, r, d_out, torch.full((HQ,), 0.25))
    assert got.dtype == torch.float64
    assert_oracle(got, gold, gold)
    with attnkit.use_kernels("sdpa"), pytest.raises(ValueError, match="computes no relevance"):
        registry.choose_relevance(call)


@pytest.mark.parametrize("kernel", ["native", "math"])
@pytest.mark.parametrize("sinks", [False, True])
def test_each_rows_weights_under_large_logits_as_exact_as_a_softmax(kernel, sinks):
    """r = one row each: the reduction returns the weights themselves. With logits near 100 (lse 40-80,
    as a trained model's can be) a float32 lse is off by up to half an ulp (4e-6 at 80), an error the
    same for its row's weights that exp(s - lse) makes a relative error of each, largest on the
    largest weight, where a softmax has none: the kernels divide it out with the row's sum."""
    from attnkit.kernels.native import build as native_build

    if kernel == "native" and not native_build.available():
        pytest.skip(native_build.status()[1])
    q, k, v, _, _ = _problem(4)
    mods = {"scale": 4.0, **({"sinks": torch.tensor([30.0, -5.0, 60.0, 0.0])} if sinks else {})}
    mask = masks.causal()
    r = torch.eye(L).expand(2, L, L)
    head_weights = torch.tensor([0.0, 0.0, 1.0, 0.0])
    _, lse = attnkit.attention(q, k, v, mask, return_lse=True, **mods)
    assert lse.abs().max() > 40
    call = functional.stats_call(q, k, v, mask, **mods)
    with attnkit.use_kernels(kernel):
        got = registry.relevance(call, RelevanceRequest(lse, r, None, head_weights))
    gold = _formula(q, k, v, mask, r, None, head_weights, **mods)
    naive = _formula(q, k, v, mask, r, None, head_weights, torch.float32, **mods)
    assert_oracle(got, gold, naive, what=f"{kernel} weights, large logits")
