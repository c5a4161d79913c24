"""attnkit.prepare: the block lists and partial bits of every mask kind equal the mask's formula,
prepared masks run every kernel as the masks they came from, and each form of evaluation
(query ranges, tiles, rows of blocks) is taken where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch
from _oracle import ALL_KERNELS, assert_oracle, dense_of, gold_and_naive, mask_kinds, naive_attention, randn
from torch.nn.attention import flex_attention

import attnkit
from attnkit import bias, masks
from attnkit.kernels import blocks
from attnkit.plan import PREPARATIONS


@pytest.mark.parametrize("name", list(mask_kinds()))
def test_prepared_masks_equal_implicit_ones(name):
    mask = mask_kinds()[name]
    q, k, v = randn(2, 4, 150, 16), randn(2, 2, 150, 16), randn(2, 2, 150, 16)
    prepared = attnkit.prepare(mask, 150, 150)
    for kernel in ALL_KERNELS:
        a = attnkit.attention(q, k, v, prepared, kernel=kernel)
        b = attnkit.attention(q, k, v, mask, kernel=kernel)
        gold, naive = gold_and_naive(q, k, v, dense_of(mask, 150, 150))
        assert_oracle(a, gold, naive, what=f"{name} {kernel} prepared")
        assert_oracle(b, gold, naive, what=f"{name} {kernel} implicit")


def test_prepared_block_lists_describe_the_block_map():
    mask = masks.document(torch.tensor([[0] * 100 + [1] * 156, [0] * 200 + [1] * 56]))
    p = attnkit.prepare(mask, 256, 256, block_size=(64, 32))
    codes = mask.block_map(256, 256, 64, 32)
    assert torch.equal(p.codes, codes)
    for b in range(2):
        for i in range(4):
            n = int(p.kv_num[b, 0, i])
            kept = (codes[b, 0, i] != masks.EMPTY).nonzero().flatten()
            assert p.kv_indices[b, 0, i, :n].tolist() == kept.tolist()
            assert p.kv_full[b, 0, i, :n].tolist() == (codes[b, 0, i, kept] == masks.FULL).tolist()
    assert "PreparedMask(document" in repr(p)


def test_prepared_mask_errors():
    p = attnkit.prepare(masks.causal(), 8, 8)
    q = randn(1, 1, 9, 4)
    with pytest.raises(ValueError, match="prepared for Lq=8, Lk=8 but is used with Lq=9, Lk=9"):
        attnkit.attention(q, q, q, p)
    with pytest.raises(TypeError, match="already a PreparedMask"):
        attnkit.prepare(p, 8, 8)
    with pytest.raises(ValueError, match="length 9 but the keys have only Lk=8"):
        attnkit.prepare(masks.padding([9]), 8, 8)


def random_documents(b, length, docs, generator=None):
    ids = []
    for _ in range(b):
        cuts = torch.sort(torch.randperm(length - 1, generator=generator)[: docs - 1] + 1).values
        row = torch.zeros(length, dtype=torch.long)
        row[cuts] = 1
        ids.append(row.cumsum(0))
    return torch.stack(ids)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_per_row_plans_with_different_layouts_per_row(dtype):
    b, length = 3, 333
    ids = random_documents(b, length, 5)
    mask = masks.document(ids) & masks.causal()
    p = attnkit.prepare(mask, length, length, block_size=(32, 16))
    assert len(blocks.groups(p)) == b  # every row its own plan
    union = (p.codes != masks.EMPTY).any(0).float().mean().item()
    assert p.kept < union  # each row visits only its own blocks
    q, k, v = (
        randn(b, 4, length, 16, dtype=dtype),
        randn(b, 2, length, 16, dtype=dtype),
        randn(b, 2, length, 16, dtype=dtype),
    )
    gold, naive = gold_and_naive(q, k, v, mask.materialize(length, length))
    assert_oracle(attnkit.attention(q, k, v, p, kernel="tiled"), gold, naive)
    # gradients, every row its own plan
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    grad = randn(b, 4, length, 16)
    naive_attention(q64, k64, v64, mask.materialize(length, length))[0].backward(grad.double())
    attnkit.attention(qg, kg, vg, p, kernel="tiled").backward(grad.to(dtype))
    for got, want in ((qg, q64), (kg, k64), (vg, v64)):
        tol = 1e-10 if dtype == torch.float64 else 5e-2 if dtype == torch.bfloat16 else 1e-4
        assert (got.grad.double() - want.grad).abs().max() < tol


def test_per_head_masks_from_fn():
    length = 200

    def per_head(b, h, q, kv):  # head h sees a window of width 40 * (h + 1) behind it
        return (kv <= q) & (q - kv < 40 * (h + 1))

    mask = masks.from_fn(per_head, num_heads=4)
    p = attnkit.prepare(mask, length, length, block_size=(32, 16))
    assert p.codes.shape[:2] == (1, 4) and len(blocks.groups(p)) == 4
    q, k, v = (
        randn(2, 4, length, 8, dtype=torch.float64),
        randn(2, 2, length, 8, dtype=torch.float64),
        randn(2, 2, length, 8, dtype=torch.float64),
    )
    want = naive_attention(q, k, v, mask.materialize(length, length))[0]
    for kernel in ALL_KERNELS:
        got = attnkit.attention(q, k, v, mask, kernel=kernel)
        assert (got - want).abs().max() < 1e-12, kernel
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    p8 = attnkit.prepare(mask, 9, 9, block_size=(4, 4))
    qs, ks, vs = (t[:, :, :9].detach().requires_grad_(True) for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: attnkit.attention(a, b, c, p8, kernel="tiled"), (qs, ks, vs))


def test_decoding_prepares_each_steps_mask_once_for_all_layers():
    """12 layers x 20 decoding steps over a batch of mixed fills: the cache masks of one step are
    equal values in every layer, so they are prepared once per step, not once per layer."""
    torch.manual_seed(0)
    layers = [attnkit.MultiHeadAttention(32, 4).eval() for _ in range(12)]
    caches = attnkit.KVCache.for_layers(12, 2, 4, 40, 8)
    alibi = bias.alibi(bias.alibi_slopes(4))  # a bias: the tiled kernel prepares the mask
    x = randn(2, 6, 32)
    with torch.no_grad():
        start = PREPARATIONS["count"]
        h = x
        for layer, cache in zip(layers, caches):
            h, _ = layer(h, mask=masks.causal(), cache=cache, counts=torch.tensor([6, 3]), attn_bias=alibi)
        assert PREPARATIONS["count"] - start == 1  # the prefill
        for _ in range(20):
            h = randn(2, 1, 32)
            for layer, cache in zip(layers, caches):
                h, _ = layer(h, mask=masks.causal(), cache=cache, attn_bias=alibi)
        assert PREPARATIONS["count"] - start == 21


def test_a_prepared_mask_is_reprepared_once_for_another_block_size():
    mask = masks.document(torch.arange(256) // 40) & masks.causal()
    prepared = attnkit.prepare(mask, 256, 256)  # the default (CPU kernel's) block size
    start = PREPARATIONS["count"]
    other = [prepared.with_block_size((64, 64)) for _ in range(5)]
    assert PREPARATIONS["count"] - start == 1 and all(p is other[0] for p in other)
    assert other[0].block_size == (64, 64) and prepared.with_block_size((128, 64)) is prepared
    torch.testing.assert_close(other[0].materialize(), prepared.materialize())


def test_prepared_facts():
    p = attnkit.prepare(masks.causal(), 300, 300)
    assert p.band == (None, 0) and p.causal_shift == 0 and not p.hides_nothing and not p.limit_only
    w = attnkit.prepare(masks.sliding_window(5, 2) & masks.causal(), 300, 300)
    assert w.band == (-5, 0) and w.causal_shift is None
    assert attnkit.prepare(masks.causal(), 1, 300).hides_nothing
    pad = attnkit.prepare(masks.padding([100, 300]), 4, 300)
    assert pad.limit_only and pad.band is None and pad.kv_limit.tolist() == [100, 300]
    assert attnkit.prepare(masks.document(torch.arange(300) // 30), 300, 300).band is None


def _structured_cases(lq, lk):
    g = torch.Generator().manual_seed(lq * 7 + lk)
    cases = {
        "causal": masks.causal(),
        "causal top-left": masks.causal(align="top_left"),
        "window": masks.sliding_window(20, 3),
        "prefix per sequence": masks.prefix_lm(torch.tensor([5, 90])),
        "padding": masks.padding(torch.tensor([lk // 2, lk])),
        "padding & causal": masks.padding(torch.tensor([lk // 3, max(lk - 1, 0)])) & masks.causal(),
        "window, offsets & prefix": masks.sliding_window(40, 0, q_offset=torch.tensor([3, 9])) & masks.prefix_lm(17),
    }
    if lq == lk:
        ids = torch.sort(torch.randint(0, 5, (2, lq), generator=g)).values
        cases["documents & causal"] = masks.document(ids) & masks.causal()
        cases["documents, descending ids"] = masks.document(ids.flip(-1))
        cases["documents & window"] = masks.document(ids[0]) & masks.sliding_window(9, 9)
    return cases


@pytest.mark.parametrize("lq, lk", [(300, 300), (257, 700), (700, 257), (1, 500), (1000, 1000)])
@pytest.mark.parametrize("block_size", [(128, 64), (13, 7), (8, 16)])
def test_partial_bits_follow_from_the_parameters(lq, lk, block_size, monkeypatch):
    """Structured masks and their "&" pack their partial tiles from per-key query ranges (no pair
    evaluated): the plan equals the mask's formula at every element, at any block size and
    ragged edge, and the range form is the one taken."""
    from attnkit import _bits

    taken = []
    by_ranges = _bits._by_ranges
    monkeypatch.setattr(_bits, "_by_ranges", lambda *a: taken.append(r := by_ranges(*a)) or r)
    for name, mask in _structured_cases(lq, lk).items():
        taken.clear()
        prepared = attnkit.prepare(mask, lq, lk, block_size=block_size)
        got, want = torch.broadcast_tensors(prepared.materialize(), mask.materialize(lq, lk))
        assert torch.equal(got, want), f"{name} at {lq}x{lk}, blocks {block_size}"
        assert not prepared.masked or (taken and taken[0] is not None), f"{name}: not packed from ranges"


def test_each_mask_is_evaluated_in_the_form_it_has(monkeypatch):
    """Ranges for structured "&", tiles for "|", unsorted document ids and predicates (written for
    one pair too: all partial tiles under one torch.vmap), rows of blocks for a BlockMask's
    mask_mod; each equal to the formula."""
    from attnkit import _bits

    seen = []
    for name in ("_by_ranges", "_by_tiles", "_by_rows"):
        real = getattr(_bits, name)
        monkeypatch.setattr(
            _bits, name, lambda *a, _real=real, _name=name: (r := _real(*a)) is not None and seen.append(_name) or r
        )

    def one_pair(b, h, q, kv):
        if q.dim() != 0:
            raise TypeError("one pair at a time")
        return (q - kv).abs() <= 3

    shuffled = torch.tensor([0] * 40 + [1] * 60 + [0] * 50 + [2] * 50)
    cases = {
        "_by_ranges": masks.document(torch.arange(200) // 70) & masks.causal(),
        "_by_tiles": masks.sliding_window(3, 3) | masks.causal(),
        "_by_tiles ": masks.document(shuffled),
        "_by_tiles  ": masks.from_fn(one_pair),
        "_by_rows": masks.from_block_mask(
            flex_attention.create_block_mask(one_pair, None, None, 200, 200, device="cpu", BLOCK_SIZE=16)
        ),
    }
    for form, mask in cases.items():
        seen.clear()
        prepared = attnkit.prepare(mask, 200, 200, block_size=(32, 16))
        assert seen == [form.strip()], (form, seen)
        assert torch.equal(*torch.broadcast_tensors(prepared.materialize(), mask.materialize(200, 200)))
