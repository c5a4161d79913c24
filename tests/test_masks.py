"""Every mask kind against a dense mask built by hand, element by element."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import masks


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
