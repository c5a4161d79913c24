"""Every mask kind against a dense mask built by hand, element by element."""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch
from _oracle import TILED_KERNELS, MaxNumel, naive_attention, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks

KERNELS = ["auto", "tiled", "reference", "sdpa"]


def by_hand(rule, lq, lk, batch=1):
    """(batch, 1, Lq, Lk) bool from a per-element rule(b, i, j)."""
    out = torch.zeros(batch, 1, lq, lk, dtype=torch.bool)
    for b in range(batch):
        for i in range(lq):
            for j in range(lk):
                out[b, 0, i, j] = bool(rule(b, i, j))
    return out


SIZES = [(1, 1), (4, 4), (3, 7), (7, 3), (6, 6)]


@pytest.mark.parametrize("lq,lk", SIZES)
def test_causal_bottom_right_and_top_left(lq, lk):
    assert torch.equal(masks.causal().materialize(lq, lk), by_hand(lambda b, i, j: j <= i + lk - lq, lq, lk))
    assert torch.equal(masks.causal(align="top_left").materialize(lq, lk), by_hand(lambda b, i, j: j <= i, lq, lk))


@pytest.mark.parametrize("lq,lk", SIZES)
@pytest.mark.parametrize("left,right", [(0, 0), (2, 0), (1, 3)])
def test_sliding_window(lq, lk, left, right):
    def rule(b, i, j):
        p = i + lk - lq
        return p - left <= j <= p + right

    assert torch.equal(masks.sliding_window(left, right).materialize(lq, lk), by_hand(rule, lq, lk))


@pytest.mark.parametrize("lq,lk", SIZES)
def test_prefix_lm(lq, lk):
    rule = lambda b, i, j: j < 2 or j <= i + lk - lq  # noqa: E731
    assert torch.equal(masks.prefix_lm(2).materialize(lq, lk), by_hand(rule, lq, lk))


def test_prefix_lm_per_sequence():
    prefix = torch.tensor([0, 3])
    rule = lambda b, i, j: j < prefix[b] or j <= i  # noqa: E731
    assert torch.equal(masks.prefix_lm(prefix).materialize(5, 5), by_hand(rule, 5, 5, batch=2))


def test_document_one_and_batched():
    ids = torch.tensor([[0, 0, 1, 1, 2], [0, 1, 1, 1, 1]])
    rule = lambda b, i, j: ids[b, i] == ids[b, j]  # noqa: E731
    assert torch.equal(masks.document(ids).materialize(5, 5), by_hand(rule, 5, 5, batch=2))
    assert torch.equal(masks.document(ids[0]).materialize(5, 5), by_hand(rule, 5, 5))


def test_padding():
    lengths = torch.tensor([2, 5, 0])
    rule = lambda b, i, j: j < lengths[b]  # noqa: E731
    got = masks.padding(lengths).materialize(3, 5)
    assert torch.equal(got.expand(3, 1, 3, 5), by_hand(rule, 3, 5, batch=3))


def test_dense_wraps_every_broadcast_shape():
    full = torch.rand(2, 3, 4, 5) > 0.5
    assert torch.equal(masks.dense(full).materialize(4, 5), full)
    row = torch.rand(2, 1, 1, 5) > 0.5
    assert torch.equal(masks.dense(row).materialize(4, 5), row.expand(2, 1, 4, 5))
    square = torch.rand(4, 5) > 0.5
    assert torch.equal(masks.dense(square).materialize(4, 5), square[None, None])


def test_and_or_combine_elementwise():
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    a, b = masks.document(ids), masks.sliding_window(1)
    da, db = a.materialize(6, 6), b.materialize(6, 6)
    assert torch.equal((a & b).materialize(6, 6), da & db)
    assert torch.equal((a | b).materialize(6, 6), da | db)
    dense = torch.rand(6, 6) > 0.5
    assert torch.equal((a & dense).materialize(6, 6), da & dense)
    assert torch.equal((dense | b).materialize(6, 6), dense | db)


def test_repr_and_picture():
    m = masks.causal() | (masks.padding([2]) & masks.prefix_lm(1))
    assert repr(m) == (
        "causal(align='bottom_right') | (padding(lengths=[2]) & prefix_lm(prefix_len=1, align='bottom_right'))"
    )
    assert masks.causal().picture(2, 3) == "1 1 0\n1 1 1"


def test_materialize_shape_is_4d_and_broadcastable():
    assert masks.causal().materialize(3, 4).shape == (1, 1, 3, 4)
    assert masks.padding([1, 2]).materialize(3, 4).shape == (2, 1, 3, 4)


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: masks.causal(align="left"), "align must be 'bottom_right' or 'top_left'"),
        (lambda: masks.sliding_window(-1), "left must be >= 0"),
        (lambda: masks.prefix_lm(-2), "prefix_len must be >= 0"),
        (lambda: masks.padding(torch.tensor([1, -1])), r"lengths must be >= 0"),
        (lambda: masks.document(torch.zeros(2, 2, 2, dtype=torch.long)), "ids must have 1 or 2"),
        (lambda: masks.padding([[1]]), "lengths must have 1 dimension"),
        (lambda: masks.padding([1, 2]) & masks.padding([1, 2, 3]), r"\(2, 1\) and \(3, 1\) differ"),
        (lambda: masks.dense(torch.ones(2, 2)), "a dense mask must be bool"),
    ],
)
def test_bad_mask_arguments(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


def test_float_ids_are_a_type_error():
    with pytest.raises(TypeError, match="ids must be an integer tensor, but got torch.float32"):
        masks.document(torch.zeros(3))


def test_masks_built_for_other_lengths():
    with pytest.raises(ValueError, match="built for sequences of length L=4 but is used with Lq=5"):
        masks.document(torch.zeros(4, dtype=torch.long)).materialize(5, 5)
    with pytest.raises(ValueError, match="length 6 but the keys have only Lk=5"):
        masks.padding([6]).materialize(5, 5)
    with pytest.raises(ValueError, match=r"built for Lq=3, Lk=3 but is used with Lq=4"):
        masks.dense(torch.ones(3, 3, dtype=torch.bool)).materialize(4, 4)


@settings(max_examples=60, deadline=None)
@given(
    lq=st.integers(1, 9),
    lk=st.integers(1, 9),
    left=st.integers(0, 4),
    prefix=st.integers(0, 9),
    top_left=st.booleans(),
    data=st.data(),
)
def test_combinations_match_their_parts(lq, lk, left, prefix, top_left, data):
    align = "top_left" if top_left else "bottom_right"
    parts = [masks.causal(align), masks.sliding_window(left, align=align), masks.prefix_lm(prefix, align)]
    a, b = data.draw(st.sampled_from(parts)), data.draw(st.sampled_from(parts))
    da, db = a.materialize(lq, lk), b.materialize(lq, lk)
    assert torch.equal((a & b).materialize(lq, lk), da & db)
    assert torch.equal((a | b).materialize(lq, lk), da | db)


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


def by_hand_per_sequence(rule, b, lq, lk):
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
        want = by_hand_per_sequence(rule, 2, lq, lk)
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
    want = by_hand_per_sequence(lambda s, i, j: ids[i + 4] == ids[j + 2], 1, 3, 6)
    assert torch.equal(m.materialize(3, 6), want)
    pad = masks.padding(torch.tensor([5, 9]), kv_offset=4)
    assert torch.equal(pad.materialize(2, 4), by_hand_per_sequence(lambda s, i, j: j + 4 < [5, 9][s], 2, 2, 4))
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
    assert attnkit.explain(q, k, v, mask).kernel in TILED_KERNELS
    assert (got - want).abs().max() < 1e-12


def test_a_mask_inside_a_kv_cache_keeps_its_block_structure():
    mha = attnkit.MultiHeadAttention(64, 4)
    cache = attnkit.KVCache(1, 4, 4096, 16)
    seen = []
    mha.register_attention_hook(lambda m, q, k, v, mask: seen.append(attnkit.explain(q, k, v, mask)))
    with torch.no_grad():
        mha(randn(1, 2048, 64), mask=masks.causal(), cache=cache)
    assert seen[0].kernel in TILED_KERNELS, str(seen[0])
    cached = masks.cached(masks.causal(), torch.tensor([0]), torch.tensor([2048]))
    p = attnkit.prepare(cached, 2048, 2048)
    assert 0.45 < p.kept < 0.6


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


# regression: a finding of the adversarial review of the inputs (hardening)
def test_3d_bool_tensor_means_the_same_alone_and_combined():
    q, k, v = (randn(2, 2, 4, 8, dtype=torch.float64) for _ in range(3))
    t = torch.rand(2, 4, 4) > 0.3
    t[..., 0] = True
    alone = attnkit.attention(q, k, v, t)
    combined = attnkit.attention(q, k, v, masks.prefix_lm(4) & t)  # prefix_lm(4) allows everything here
    assert torch.allclose(alone, combined, atol=1e-12)
    want = naive_attention(q, k, v, t)[0]  # SDPA's rule: (2, 4, 4) is (H, Lq, Lk)
    assert torch.allclose(alone, want, atol=1e-12)


# regression: a finding of the adversarial review of the inputs (hardening)
def test_a_mask_reused_with_inputs_of_another_rank_gives_their_shape():
    m = masks.causal()
    assert attnkit.attention_weights(randn(1, 2, 5, 8), randn(1, 2, 7, 8), randn(1, 2, 7, 8), m).shape == (1, 2, 5, 7)
    assert attnkit.attention_weights(randn(5, 8), randn(7, 8), randn(7, 8), m).shape == (5, 7)


# regression: a finding of the adversarial review of the inputs (hardening)
def test_a_mask_does_not_change_when_its_source_tensor_does():
    lengths = torch.tensor([3, 5])
    m = masks.padding(lengths)
    q, k, v = (randn(2, 1, 6, 8, dtype=torch.float64) for _ in range(3))
    before = attnkit.attention(q, k, v, m)
    lengths.numpy()[0] = 300  # no version bump
    assert torch.equal(attnkit.attention(q, k, v, m), before)


# regression: a finding of the adversarial review of the inputs (hardening)
@pytest.mark.parametrize("kernel", KERNELS)
def test_1d_and_0d_bool_masks_broadcast_like_sdpa(kernel):
    q, k, v = (randn(2, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    keys = torch.tensor([True, True, False, True, False, True])
    assert torch.allclose(
        attnkit.attention(q, k, v, keys, kernel=kernel), naive_attention(q, k, v, keys[None])[0], atol=1e-12
    )
    assert torch.allclose(
        attnkit.attention(q, k, v, torch.tensor(True), kernel=kernel), naive_attention(q, k, v)[0], atol=1e-12
    )
    assert attnkit.attention_weights(q, k, v, keys)[..., 2].abs().max() == 0


# regression: a finding of the adversarial review of the inputs (hardening)
def test_a_leading_1_mask_for_2d_inputs_is_accepted():
    q, k, v = (randn(6, 8, dtype=torch.float64) for _ in range(3))
    t = torch.ones(1, 6, 6, dtype=torch.bool).tril()
    assert torch.allclose(attnkit.attention(q, k, v, t), attnkit.attention(q, k, v, masks.causal()), atol=1e-12)


# regression: a finding of the adversarial review of the inputs (hardening)
def test_inputs_with_two_batch_dims_line_padding_up_with_the_inner_one():
    """Masks broadcast from the right, like SDPA's: with q (B1, B2, H, L, D), a padding mask's
    batch axis is B2 (documented in attnkit.masks)."""
    q = randn(2, 3, 1, 5, 8)
    w = attnkit.attention_weights(q, q, q, masks.padding(torch.tensor([2, 4, 5])))
    for inner, n in enumerate([2, 4, 5]):
        assert (w[:, inner, :, :, n:] == 0).all() and torch.allclose(w[:, inner].sum(-1), torch.ones(2, 1, 5))


# regression: finding F22 of the review of the seams between features
@pytest.mark.parametrize("length", [64, 300, 6000])
def test_dense_mask_copies_its_tensor(length):
    t = torch.ones(length, length, dtype=torch.bool).tril()
    m = masks.dense(t)
    q = randn(1, 1, length, 8)
    before = attnkit.attention(q, q, q, m)
    t.fill_(True)  # the user's tensor changes; the mask does not
    after = attnkit.attention(q, q, q, m)
    torch.testing.assert_close(before, after, atol=0, rtol=0)
    torch.testing.assert_close(after, attnkit.attention(q, q, q, masks.causal(), kernel="reference"))


# regression: finding F22 of the review of the seams between features
def test_dense_mask_copy_keeps_broadcast_dimensions():
    base = torch.rand(1, 1, 512, 512) > 0.5
    m = masks.dense(base.expand(64, 16, 512, 512))  # 268M elements if materialised
    assert m.tensor.untyped_storage().nbytes() == 512 * 512
    assert m.tensor.shape == (64, 16, 512, 512)


def check_block_map(mask, lq, lk, bq, bk, exact):
    codes = mask.block_map(lq, lk, bq, bk)
    dense = mask.materialize(lq, lk)
    nq, nk = -(-lq // bq), -(-lk // bk)
    assert codes.shape[-2:] == (nq, nk)
    codes = codes.expand(*torch.broadcast_shapes(codes.shape[:2], dense.shape[:2]), nq, nk)
    dense = dense.expand(*codes.shape[:2], lq, lk)
    for i in range(nq):
        for j in range(nk):
            block = dense[..., i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            c = codes[..., i, j]
            empty, full = ~block.flatten(-2).any(-1), block.flatten(-2).all(-1)
            assert not (c == masks.EMPTY)[~empty].any(), f"block ({i}, {j}) called empty"
            assert not (c == masks.FULL)[~full].any(), f"block ({i}, {j}) called full"
            if exact:
                assert torch.equal(c == masks.EMPTY, empty) and torch.equal(c == masks.FULL, full)


def primitive_masks(draw, lq, lk, batch):
    align = draw(st.sampled_from(["bottom_right", "top_left"]))
    kind = draw(st.sampled_from(["causal", "window", "prefix", "padding", "document", "dense", "from_fn"]))
    if kind == "causal":
        return masks.causal(align)
    if kind == "window":
        return masks.sliding_window(draw(st.integers(0, 9)), draw(st.integers(0, 5)), align)
    if kind == "prefix":
        return masks.prefix_lm(draw(st.integers(0, lk)), align)
    if kind == "padding":
        return masks.padding(torch.tensor(draw(st.lists(st.integers(0, lk), min_size=batch, max_size=batch))))
    if kind == "document" and lq == lk:
        ids = draw(st.lists(st.integers(0, 3), min_size=lq, max_size=lq))
        return masks.document(torch.tensor(sorted(ids)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if kind == "from_fn":  # a predicate over a random table, per sequence and head (its blocks: all, none, some)
        table = torch.rand(batch, 3, lq, lk, generator=g) > draw(st.sampled_from([0.0, 0.5, 1.0]))
        return masks.from_fn(lambda b, h, q, kv: table[b, h, q, kv], batch_size=batch, num_heads=3)
    return masks.dense(torch.rand(batch, 1, lq, lk, generator=g) > draw(st.sampled_from([0.0, 0.5, 1.0])))


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_block_maps_match_materialized_masks(data):
    lq, lk = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 40))
    bq, bk = data.draw(st.sampled_from([1, 3, 4, 8])), data.draw(st.sampled_from([1, 2, 5, 8]))
    a = primitive_masks(data.draw, lq, lk, 2)
    check_block_map(a, lq, lk, bq, bk, exact=not repr(a).startswith("document("))  # unsorted ids: PARTIAL may be loose
    b = primitive_masks(data.draw, lq, lk, 2)
    check_block_map(a & b, lq, lk, bq, bk, exact=False)
    check_block_map(a | b, lq, lk, bq, bk, exact=False)


def test_document_block_map_is_exact_for_packed_ids():
    ids = torch.tensor([0] * 10 + [1] * 6 + [2] * 16)
    check_block_map(masks.document(ids), 32, 32, 8, 8, exact=True)


def test_block_map_never_materializes_a_matrix():
    with MaxNumel() as seen:
        masks.causal().block_map(100_000, 100_000, 256, 64)
        (masks.document(torch.arange(100_000) // 5000) & masks.sliding_window(300)).block_map(100_000, 100_000, 256, 64)
    assert seen.largest < 1_000_000
