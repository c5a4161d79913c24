"""TODO"""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch
from _oracle import assert_oracle, gold_and_naive, randn

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
