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
