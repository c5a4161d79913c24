"""The core opened up: prepared masks, per-row plans, offsets, from_fn masks, return_lse,
the kernel registry, torch.compile, inference mode, hooks and masks as values."""

import sys

import pytest
import torch
import torch.nn.functional as F
import torch.utils._python_dispatch
from conftest import assert_oracle, gold_and_naive, naive_attention, pin_engine, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit.kernels import KERNELS

ALL_KERNELS = ["auto", "sdpa", "tiled", "reference"]


def mask_kinds(b=2, length=150):
    ids = torch.sort(torch.randint(0, 4, (b, length)), dim=-1).values
    return {
        "causal": masks.causal(),
        "window": masks.sliding_window(9),
        "prefix": masks.prefix_lm(20) & masks.causal(),
        "padding": masks.padding(torch.tensor([70, length])),
        "document": masks.document(ids) & masks.causal(),
        "bool": torch.rand(b, 1, length, length) > 0.5,
        "from_fn": masks.from_fn(lambda b_, h, q, kv: (q - kv).abs() <= 5),
        "cached": masks.cached(masks.causal(), torch.tensor([0, 0]), torch.tensor([length, 100])),
    }


def dense_of(mask, lq, lk):
    return mask if isinstance(mask, torch.Tensor) else mask.materialize(lq, lk)


# --- inference mode, no_grad ----------------------------------------------------------------


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


# --- masks are values -------------------------------------------------------------------------


def test_changing_a_tensor_after_building_a_mask_changes_nothing():
    lengths = torch.tensor([3, 5])
    mask = masks.padding(lengths)
    q = k = v = randn(2, 1, 5, 4, dtype=torch.float64)
    before = attnkit.attention(q, k, v, mask)
    lengths.numpy()[0] = 1  # no version bump
    lengths[1] = 2
    assert torch.equal(attnkit.attention(q, k, v, mask), before)
    assert mask.lengths.tolist() == [3, 5]


def test_no_attribute_is_written_onto_a_users_mask():
    mask = masks.document(torch.arange(600) // 100) & masks.causal()
    before = {name: set(vars(m)) for name, m in (("all", mask), ("left", mask.left), ("right", mask.right))}
    q = randn(1, 2, 600, 8, requires_grad=True)
    attnkit.attention(q, q, q, mask).sum().backward()
    attnkit.explain(q, q, q, mask)
    after = {name: set(vars(m)) for name, m in (("all", mask), ("left", mask.left), ("right", mask.right))}
    assert before == after


def test_implicit_cache_is_bounded():
    prep = sys.modules["attnkit.prepare"]

    prep.clear_cache()
    q = randn(1, 1, 300, 8)
    for i in range(prep.IMPLICIT_CACHE_SIZE + 5):
        attnkit.attention(q, q, q, masks.sliding_window(i + 1))
    assert len(prep._implicit) == prep.IMPLICIT_CACHE_SIZE


# --- prepared masks -------------------------------------------------------------------------


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


# --- per-row plans -----------------------------------------------------------------------


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
    assert len(p.groups) == b  # every row its own plan
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
    assert p.codes.shape[:2] == (1, 4) and len(p.groups) == 4
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


# --- offsets ---------------------------------------------------------------------------


def by_hand(rule, b, lq, lk):
    return torch.tensor([[[[bool(rule(s, i, j)) for j in range(lk)] for i in range(lq)]] for s in range(b)])


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_offsets_against_masks_built_by_hand(align):
    lq, lk = 5, 12
    qo, ko = torch.tensor([3, 6]), torch.tensor([0, 2])

    def p(s, i):
        base = i + int(qo[s])
        return base + (lk - lq if align == "bottom_right" else 0)

    cases = [
        (masks.causal(align, q_offset=qo, kv_offset=ko), lambda s, i, j: j + ko[s] <= p(s, i)),
        (
            masks.sliding_window(2, 1, align, q_offset=qo, kv_offset=ko),
            lambda s, i, j: p(s, i) - 2 <= j + ko[s] <= p(s, i) + 1,
        ),
        (masks.prefix_lm(4, align, q_offset=qo, kv_offset=ko), lambda s, i, j: j + ko[s] < 4 or j + ko[s] <= p(s, i)),
        (masks.causal(align, q_offset=3), lambda s, i, j: j <= i + 3 + (lk - lq if align == "bottom_right" else 0)),
    ]
    for mask, rule in cases:
        want = by_hand(rule, 2, lq, lk)
        assert torch.equal(mask.materialize(lq, lk).expand(2, 1, lq, lk), want), repr(mask)
        for bq, bk in ((1, 1), (2, 3), (4, 4)):
            codes = mask.block_map(lq, lk, bq, bk).expand(2, 1, -1, -1)
            for i in range(codes.shape[2]):
                for j in range(codes.shape[3]):
                    block = want[:, :, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].flatten(1)
                    assert not ((codes[:, 0, i, j] == masks.EMPTY) & block.any(1)).any()
                    assert not ((codes[:, 0, i, j] == masks.FULL) & ~block.all(1)).any()


def test_document_and_padding_offsets():
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    m = masks.document(ids, q_offset=4, kv_offset=2)
    want = by_hand(lambda s, i, j: ids[i + 4] == ids[j + 2], 1, 3, 6)
    assert torch.equal(m.materialize(3, 6), want)
    pad = masks.padding(torch.tensor([5, 9]), kv_offset=4)
    assert torch.equal(pad.materialize(2, 4), by_hand(lambda s, i, j: j + 4 < [5, 9][s], 2, 2, 4))
    with pytest.raises(ValueError, match="reaches past them"):
        masks.document(ids, q_offset=8).materialize(3, 3)


def test_chunked_prefill_into_a_static_cache_keeps_its_structure():
    """Queries at positions 256..511 of a 1024-slot static cache: a causal chunk."""
    size, start, chunk = 1024, 256, 256
    mask = masks.causal("top_left", q_offset=start)
    p = attnkit.prepare(mask, chunk, size)
    assert p.kept < 0.5  # the slots past the chunk are skipped
    q, k, v = (
        randn(1, 2, chunk, 16, dtype=torch.float64),
        randn(1, 2, size, 16, dtype=torch.float64),
        randn(1, 2, size, 16, dtype=torch.float64),
    )
    k[:, :, start + chunk :] = float("nan")  # empty slots of the static cache
    v[:, :, start + chunk :] = float("nan")
    want = naive_attention(
        q, k[:, :, : start + chunk], v[:, :, : start + chunk], mask.materialize(chunk, start + chunk)
    )[0]
    got = attnkit.attention(q, k, v, mask)
    assert attnkit.explain(q, k, v, mask).kernel == "tiled"
    assert (got - want).abs().max() < 1e-12


def test_a_mask_inside_a_kv_cache_keeps_its_block_structure():
    mha = attnkit.MultiHeadAttention(64, 4)
    cache = attnkit.KVCache(1, 4, 4096, 16)
    seen = []
    mha.register_attention_hook(lambda m, q, k, v, mask: seen.append(attnkit.explain(q, k, v, mask)))
    with torch.no_grad():
        mha(randn(1, 2048, 64), mask=masks.causal(), cache=cache)
    assert seen[0].kernel == "tiled", str(seen[0])
    cached = masks.cached(masks.causal(), torch.tensor([0]), torch.tensor([2048]))
    p = attnkit.prepare(cached, 2048, 2048)
    assert 0.45 < p.kept < 0.6


# --- from_fn --------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    lq=st.integers(1, 40),
    lk=st.integers(1, 40),
    w=st.integers(0, 6),
    m=st.integers(1, 5),
    bq=st.sampled_from([1, 3, 8]),
    bk=st.sampled_from([1, 4, 16]),
)
def test_from_fn_block_maps_against_materialized_masks(lq, lk, w, m, bq, bk):
    mask = masks.from_fn(lambda b, h, q, kv: ((q - kv).abs() <= w) | (kv % m == 0), num_heads=1)
    dense = mask.materialize(lq, lk)
    codes = mask.block_map(lq, lk, bq, bk)
    for i in range(codes.shape[2]):
        for j in range(codes.shape[3]):
            block = dense[0, 0, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            c = int(codes[0, 0, i, j])
            assert c == (masks.EMPTY if not block.any() else masks.FULL if block.all() else masks.PARTIAL)
    combined = mask & masks.causal()
    assert torch.equal(combined.materialize(lq, lk), dense & masks.causal().materialize(lq, lk))


def test_from_fn_errors():
    with pytest.raises(TypeError, match="must return a bool tensor"):
        masks.from_fn(lambda b, h, q, kv: (q - kv).float()).materialize(3, 3)
    with pytest.raises(TypeError, match="from_fn takes a function"):
        masks.from_fn(3)


# --- return_lse ----------------------------------------------------------------------------


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


def test_sdpa_refuses_return_lse_with_a_reason():
    q = randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="kernel='sdpa' cannot run this call: does not return the log-sum-exp"):
        attnkit.attention(q, q, q, kernel="sdpa", return_lse=True)


# --- the registry and explain -------------------------------------------------------------------


def test_explain_lists_every_other_kernels_reasons():
    q = randn(1, 2, 2048, 16)
    plan = attnkit.explain(q, q, q, masks.document(torch.arange(2048) // 256), dropout_p=0.0, return_lse=True)
    assert plan.kernel == "tiled"
    assert set(plan.rejected) == set(KERNELS) - {"tiled"}
    assert plan.rejected["sdpa"] == ("does not return the log-sum-exp (return_lse=True)",)
    report = plan.report()
    assert report.startswith("chosen tiled:") and "sdpa: does not return the log-sum-exp" in report
    rank5 = attnkit.explain(q[None], q[None], q[None], masks.causal() & masks.sliding_window(3))
    assert "takes inputs of rank 2 to 4, not 5" in rank5.rejected["tiled"][0]


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


def test_double_backward_through_the_tiled_kernel_is_refused_clearly():
    q, k, v = (randn(1, 1, 300, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = attnkit.attention(q, k, v, masks.sliding_window(32), kernel="tiled")
    with pytest.raises(ValueError, match="first derivatives only.*kernel='reference'"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    ref = attnkit.attention(q, k, v, masks.sliding_window(32), kernel="reference")
    (g,) = torch.autograd.grad(ref.sum(), q, create_graph=True)
    assert g.requires_grad


# --- torch.compile -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["none", "causal", "window", "padding", "document"])
def test_compile_fullgraph_with_no_graph_breaks(name):
    torch._dynamo.reset()
    cases = {
        "none": None,
        "causal": masks.causal(),
        "window": masks.sliding_window(8),
        "padding": masks.padding(torch.tensor([40, 64])),
        "document": masks.document(torch.arange(64) // 16),
    }
    mask = cases[name]
    q, k, v = randn(2, 4, 64, 16), randn(2, 4, 64, 16), randn(2, 4, 64, 16)
    compiled = torch.compile(attnkit.attention, fullgraph=True, backend="eager")
    got = compiled(q, k, v, mask)
    gold, naive = gold_and_naive(q, k, v, None if mask is None else mask.materialize(64, 64))
    assert_oracle(got, gold, naive)
    assert_oracle(attnkit.attention(q, k, v, mask), gold, naive)
    explained = torch._dynamo.explain(attnkit.attention)(q, k, v, mask)
    assert explained.graph_break_count == 0


# --- hooks ----------------------------------------------------------------------------------------


def test_attention_hooks_are_removable_handles():
    mha = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2)
    calls = []
    handle = mha.register_attention_hook(lambda m, q, k, v, mask: calls.append((m, q.shape, k.shape, mask)))
    x = randn(2, 5, 16)
    mha(x, mask=masks.causal())
    assert calls[0][0] is mha and calls[0][1] == (2, 4, 5, 4) and calls[0][2] == (2, 2, 5, 4)
    handle.remove()
    mha(x)
    assert len(calls) == 1
    with pytest.raises(TypeError, match="hook must be callable"):
        mha.register_attention_hook(3)


# --- KV cache bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "counts,exc,match",
    [
        ([1.5, 2.9], TypeError, "counts must hold integers"),
        (torch.tensor([True, False]), TypeError, "counts must hold integers"),
        ([1, 2, 3], ValueError, r"counts must have shape \(2,\)"),
        ([1, 4], ValueError, r"counts must lie in 0..3"),
        ("12", TypeError, "counts must be a sequence"),
    ],
)
def test_kv_cache_counts_are_checked(counts, exc, match):
    cache = attnkit.KVCache(2, 2, 8, 4)
    with pytest.raises(exc, match=match):
        cache.append(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4), counts)


def test_kv_cache_dtype_and_rank_errors():
    cache = attnkit.KVCache(2, 2, 8, 4)
    with pytest.raises(TypeError, match=r"Build the cache with KVCache\(..., dtype=torch.float64\)"):
        cache.append(torch.randn(2, 2, 3, 4, dtype=torch.float64), torch.randn(2, 2, 3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="must have 4 dimensions"):
        cache.append(torch.randn(2, 3, 4), torch.randn(2, 3, 4))


def test_kv_cache_padded_appends_and_capacity():
    cache = attnkit.KVCache(2, 1, 4, 2)
    k = torch.randn(2, 1, 3, 2)
    cache.append(k, k, torch.tensor([3, 1]))
    assert cache.lengths.tolist() == [3, 1]
    assert torch.equal(cache.keys[1, :, :1], k[1, :, :1]) and (cache.keys[1, :, 1:] == 0).all()
    cache.append(torch.randn(2, 1, 1, 2), torch.randn(2, 1, 1, 2))
    with pytest.raises(ValueError, match="sequence 0 holds 4 entries and 1 more do not fit in max_len=4"):
        cache.append(torch.randn(2, 1, 1, 2), torch.randn(2, 1, 1, 2))


def test_dispatch_is_device_aware():
    """Off the CPU, auto never picks the tiled kernel's Python loop (meta tensors stand in for a GPU)."""
    q = torch.empty(1, 2, 2048, 16, device="meta")
    plan = attnkit.explain(q, q, q, masks.sliding_window(64) & masks.causal())
    assert plan.kernel == "sdpa"
    assert "Python loop" in plan.rejected["tiled"][0] and "kernel='tiled' forces it" in plan.rejected["tiled"][0]


class Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every ATen op and the size of the new memory it creates (views excluded)."""

    def __init__(self):
        super().__init__()
        self.names, self.largest = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.append(str(func))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


def test_decoding_with_a_prepared_padding_mask_neither_copies_kv_nor_syncs():
    q, k, v = randn(1, 8, 1, 64), randn(1, 8, 4096, 64), randn(1, 8, 4096, 64)
    k[:, :, 4000:] = float("nan")  # padding holds junk: it is never read
    prepared = attnkit.prepare(masks.padding(torch.tensor([4000])), 1, 4096)
    with torch.no_grad(), Ops() as ops:
        out = attnkit.attention(q, k, v, prepared)
    assert torch.isfinite(out).all()
    assert ops.largest < k.numel() // 8, ops.largest  # no copy of K or V
    assert not any("_local_scalar_dense" in name for name in ops.names)  # no .item()/bool()/.tolist()


def test_a_prepared_mask_reused_makes_no_host_sync():
    q = randn(2, 2, 700, 16, requires_grad=True)
    prepared = attnkit.prepare(masks.sliding_window(40) & masks.padding(torch.tensor([700, 500])), 700, 700)
    attnkit.attention(q, q, q, prepared).sum().backward()  # first use evaluates and keeps its tiles
    with Ops() as ops:
        attnkit.attention(q, q, q, prepared).sum().backward()
    assert not any("_local_scalar_dense" in name for name in ops.names)


def test_decoding_over_a_growing_cache_is_validated_once(monkeypatch):
    """An unmasked step over a cache one key longer each time reuses the first step's checks and
    choice (SDPA's runner is the same for any Lk >= 1); wrong lengths and Lk = 0 still get theirs."""
    import attnkit.functional as fn

    validated = []
    real = fn._call
    monkeypatch.setattr(fn, "_call", lambda *a, **kw: validated.append(1) or real(*a, **kw))
    q, keys, values = randn(1, 4, 1, 24), randn(1, 2, 90, 24), randn(1, 2, 90, 24)
    with torch.no_grad():
        for n in range(40, 90):
            k, v = keys[:, :, :n], values[:, :, :n]
            out = attnkit.attention(q, k, v)
            gold, naive = gold_and_naive(q, k, v, None)
            # TESTING.md: where attnkit calls SDPA, the bound is 2x the larger of the naive formula's
            # and SDPA's own error (one query row: the naive error alone can be a lucky rounding).
            sdpa = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            worse = max(naive, sdpa, key=lambda t: (t.double() - gold).abs().max().item())
            assert_oracle(out, gold, worse, what=f"Lk={n}")
        assert len(validated) <= 1
        with pytest.raises(ValueError, match="same length Lk"):
            attnkit.attention(q, keys[:, :, :50], values[:, :, :49])
        for bad_k, bad_v in [(keys[0, 0, :50], values[:, :, :50]), (keys[:, :, :50], values[0, :, :50])]:
            with pytest.raises(ValueError, match="same number of dimensions"):
                attnkit.attention(q, bad_k, bad_v)
        assert torch.equal(attnkit.attention(q, keys[:, :, :0], values[:, :, :0]), torch.zeros(1, 4, 1, 24))


def test_kv_cache_append_makes_no_host_sync_while_it_has_room():
    cache = attnkit.KVCache(2, 2, 64, 8)
    with Ops() as ops:
        for _ in range(5):
            cache.append(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
            cache.stored()
            cache.mask(masks.causal())
    assert not any("_local_scalar_dense" in name for name in ops.names)
    assert cache.lengths.tolist() == [5, 5]


# --- one fused call where the mask is a plain causal square or hides nothing --------------------


@pytest.mark.parametrize("offsets", [(0, 0), (37, 37)])
def test_tiled_causal_square_with_equal_offsets_is_one_fused_call_forward_and_backward(offsets, monkeypatch):
    from attnkit.kernels import _aten

    pin_engine(monkeypatch, "fused")
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        real = getattr(_aten, f"flash_{name}")

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(_aten, f"flash_{name}", counted)
    mask = masks.causal(q_offset=offsets[0], kv_offset=offsets[1])
    q, k, v = (randn(2, 3, 300, 16, requires_grad=True) for _ in range(3))
    out, lse = attnkit.attention(q, k, v, mask, kernel="tiled", return_lse=True)
    dout = randn(2, 3, 300, 16)
    out.backward(dout)
    assert calls == {"forward": 1, "backward": 1}, calls  # not one call per row block
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    dense = torch.ones(300, 300, dtype=torch.bool).tril()
    gold, _ = naive_attention(q64, k64, v64, dense)
    gold.backward(dout.double())
    for got, want in ((out, gold), (q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


def test_a_decoding_step_with_a_causal_mask_goes_to_sdpa_unmasked():
    q, k, v = randn(2, 4, 1, 16), randn(2, 4, 600, 16), randn(2, 4, 600, 16)
    assert str(attnkit.explain(q, k, v, masks.causal())) == "sdpa: the mask hides nothing here"
    torch.testing.assert_close(
        attnkit.attention(q, k, v, masks.causal()), attnkit.attention(q, k, v, masks.causal(), kernel="reference")
    )
    # the top-left causal of one query sees one key: not "nothing hidden"
    assert "hides nothing" not in str(attnkit.explain(q, k, v, masks.causal("top_left")))
    torch.testing.assert_close(attnkit.attention(q, k, v, masks.causal("top_left")), v[:, :, :1])


def test_many_unused_rows_are_zeroed_by_one_copy():
    from attnkit.kernels import reference

    k, v = randn(2, 4, 64, 16), randn(2, 4, 64, 16)
    k[1, :, 20:] = float("nan")
    allowed = masks.padding(torch.tensor([64, 20])).materialize(1, 64)
    k2, v2 = reference.zero_unused_keys(k, v, allowed)
    assert (k2[1, :, 20:] == 0).all() and (v2[1, :, 20:] == 0).all() and torch.equal(k2[0], k[0])


def test_small_padding_masks_read_only_each_sequences_keys():
    q, k, v = randn(3, 4, 1, 16), randn(3, 4, 500, 16), randn(3, 4, 500, 16)
    mask = masks.padding(torch.tensor([500, 120, 7]))
    assert "keys past each sequence's end unread" in str(attnkit.explain(q, k, v, mask))
    gold, naive = gold_and_naive(q, k, v, mask.materialize(1, 500))
    assert_oracle(attnkit.attention(q, k, v, mask), gold, naive)


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
