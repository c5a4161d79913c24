"""NaN and Inf follow the formula, on every kernel, forward and backward.

The formula is attention over the pairs the mask keeps, in float64: a NaN or Inf in a query, key
or value that some visible pair reads makes NaN (or Inf) what the formula makes NaN; a row that sees
no key gives 0 and lse -inf, and only such a row has lse -inf; NaN or Inf in keys no query may see
never reach anything. Every NaN the formula has must be NaN in the kernel's result (no kernel may
answer finite where the formula cannot). Outside those positions a kernel may also be NaN where a
tile it computes holds both the poisoned key and a pair that hides it (0 * NaN), as SDPA's dense
masks and the fused kernel's tiles do; other sequences of the batch are never touched.
"""

from __future__ import annotations

import pytest
import torch
from _oracle import randn

import attnkit
from attnkit import masks

B, H, L, D = 2, 2, 150, 16
KERNELS = ["native", "fused", "math", "sdpa", "reference", "triton"]
POISON = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
ROW_WITHOUT_KEYS = 5


def _mask():
    """Causal; row 5 sees no key; sequence 1's last 20 keys are hidden from every query."""
    return (
        masks.causal()
        & masks.from_fn(lambda b, h, i, j: i != ROW_WITHOUT_KEYS)
        & masks.padding(torch.tensor([L, L - 20]))
    )


def formula(q, k, v, allowed, scale):
    """(out, lse) over the visible pairs in float64; a row that sees nothing gives 0 and -inf.

    Every product is formed per pair with the hidden pairs' operands set to 0 first, so that
    autograd never multiplies a hidden pair's 0 by a NaN (as ``q @ k^T`` and ``p @ v`` would:
    their gradients then say NaN where no visible pair reads it)."""
    a = allowed[..., None]  # (B, H, Lq, Lk, 1)
    qe = torch.where(a, q[:, :, :, None, :], 0.0)
    ke = torch.where(a, k[:, :, None, :, :], 0.0)
    s = (qe * ke).sum(-1) * scale  # (B, H, Lq, Lk)
    s = s.masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(-1, keepdim=True)
    p = torch.where(allowed & ~empty, torch.softmax(s, -1), 0.0)
    ve = torch.where(a, v[:, :, None, :, :], 0.0)
    lse = torch.where(empty[..., 0], float("-inf"), torch.logsumexp(s, -1))
    return (p[..., None] * ve).sum(-2), lse


def _run(kernel, q, k, v, mask):
    if kernel == "sdpa":
        out = attnkit.attention(q, k, v, mask, kernel=kernel)
        return out, None
    return attnkit.attention(q, k, v, mask, kernel=kernel, return_lse=True)


def _skip_unavailable(kernel):
    from attnkit.kernels.native import build as native_build
    from attnkit.kernels.runs import aten as _aten
    from attnkit.kernels.triton import kernel as triton_attention

    if kernel == "native" and not native_build.available():
        pytest.skip(native_build.status()[1])
    if kernel == "fused" and not _aten.AVAILABLE:
        pytest.skip("PyTorch's fused CPU kernel is not available")
    if kernel == "triton" and not (triton_attention.AVAILABLE and triton_attention.interpreted()):
        pytest.skip("Triton is not installed or not interpreted")


def _poisoned(where: str, value: float, visible: bool):
    q, k, v = (randn(B, H, L, D) for _ in range(3))
    t = {"q": q, "k": k, "v": v}[where]
    if where == "q":
        t[0, 0, 140 if visible else ROW_WITHOUT_KEYS, 3] = value  # row 140 sees keys 0-140
    else:
        if visible:
            t[0, 0, 60, 3] = value  # key 60: seen by rows 60.. of sequence 0, head 0
        else:
            t[1, 0, L - 5, 3] = value  # a key of sequence 1 past its length: no query sees it
    return q, k, v


@pytest.mark.parametrize("visible", [True, False], ids=["visible", "hidden"])
@pytest.mark.parametrize("poison", list(POISON))
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_nan_and_inf_follow_the_formula(kernel, where, poison, visible):
    _skip_unavailable(kernel)
    mask = _mask()
    allowed = attnkit.prepare(mask, L, L).materialize().expand(B, H, L, L)
    scale = D**-0.5
    q, k, v = _poisoned(where, POISON[poison], visible)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    gold, gold_lse = formula(q64, k64, v64, allowed, scale)
    up = randn(B, H, L, D, dtype=torch.float64)
    gold_grads = torch.autograd.grad(gold, (q64, k64, v64), up)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = _run(kernel, qq, kk, vv, mask)
    grads = torch.autograd.grad(out, (qq, kk, vv), up.float())
    what = f"{kernel} {where}={poison} {'visible' if visible else 'hidden'}"

    # every NaN of the formula is NaN here, forward and backward
    assert torch.isnan(out)[torch.isnan(gold)].all(), f"finite output where the formula is NaN: {what}"
    for name, g, w in zip("qkv", grads, gold_grads):
        assert torch.isnan(g)[torch.isnan(w)].all(), f"finite d{name} where the formula's is NaN: {what}"
    # the other sequence is untouched, and so is everything when nobody sees the poison
    clean_q, clean_k, clean_v = (t.nan_to_num(0.0, 0.0, 0.0) for t in (q, k, v))
    clean_out, _ = formula(*(t.double() for t in (clean_q, clean_k, clean_v)), allowed, scale)
    poisoned_sequence = 1 if (where != "q" and not visible) else 0
    other = 1 - poisoned_sequence
    assert torch.isfinite(out[other]).all(), what
    torch.testing.assert_close(out[other].double(), clean_out[other], atol=2e-5, rtol=1e-4)
    assert all(torch.isfinite(g[other]).all() for g in grads), what
    if not visible:  # a poison no pair reads: the whole result is the clean one
        assert torch.isfinite(out).all(), what
        torch.testing.assert_close(out.double(), clean_out, atol=2e-5, rtol=1e-4)
        assert all(torch.isfinite(g).all() for g in grads), what
    # lse: -inf exactly for the rows that see no key, and for no other row
    if lse is not None:
        no_keys = gold_lse == float("-inf")
        assert (lse[no_keys] == float("-inf")).all(), what
        assert not (lse[~no_keys] == float("-inf")).any(), f"lse -inf for a row that sees keys: {what}"
        assert not torch.isfinite(lse[~torch.isfinite(gold_lse) & ~no_keys]).any(), what
    # rows that see no key: 0 and no gradient, whatever their query holds
    assert (out[:, :, ROW_WITHOUT_KEYS] == 0).all(), what
    assert (grads[0][:, :, ROW_WITHOUT_KEYS] == 0).all(), what
