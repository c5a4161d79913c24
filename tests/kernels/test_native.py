"""The native kernel (attnkit.kernels.native: C++ operators) against the float64 oracle.

Every test here runs kernel="native" (skipped where it cannot be built); the other kernels keep
their own tests, and the suite runs once more with ATTNKIT_NATIVE=0 (make test-torch). Its
build, cache and operator registrations: test_native_build.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _oracle import (
    OpCounter,
    alibi_formula,
    assert_oracle,
    gold_and_naive,
    naive_attention,
    oracle,
    pin_engine,
    randn,
    relative_formula,
)

import attnkit
from attnkit import bias, masks
from attnkit.kernels.native import build as native_build

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _native(request):
    pin_engine(request, "native")


@pytest.fixture
def spy():
    """Counts the native operators' forward and backward calls (through PyTorch's dispatcher)."""
    with OpCounter("attnkit::native_forward", "attnkit::native_backward") as counter:
        yield counter


def check_forward_and_gradients(q, k, v, mask, what, scale=None, theirs=None, small=False, **ours):
    """attnkit (native) against the oracle in float64 and in the inputs' dtype: out 2x, gradients 3x.
    ``ours``: attnkit's modification arguments; ``theirs``: the oracle's (float64 tensors);
    ``small``: a few query rows (each dK/dV entry sums a few products: TESTING.md's floor)."""
    theirs = theirs or {}
    allowed = allowed_of(mask, q.shape[2], k.shape[2])
    out = attnkit.attention(q, k, v, mask, kernel="native", scale=scale, **ours)
    q64, k64, v64 = (t.detach().double().requires_grad_(q.requires_grad) for t in (q, k, v))
    gold = oracle(q64, k64, v64, allowed, scale=scale, **theirs)
    low = {n: (t.to(q.dtype) if isinstance(t, torch.Tensor) else t) for n, t in theirs.items()}
    naive = oracle(q, k, v, allowed, scale=scale, **low)
    assert_oracle(out, gold, naive, what=what, small=small)
    if not q.requires_grad:
        return
    up = torch.randn(out.shape, dtype=torch.float64)
    got, naive_grads = (torch.autograd.grad(o, (q, k, v), up.to(o.dtype)) for o in (out, naive))
    want = torch.autograd.grad(gold, (q64, k64, v64), up)  # float64 leaves: gold's gradients unrounded
    for name, o, g, n in zip("qkv", got, want, naive_grads):
        assert_oracle(o, g, n, factor=3.0, what=f"d{name} {what}", small=small)


MASKS = {
    "none": lambda b, h, lq, lk: None,
    "causal": lambda b, h, lq, lk: masks.causal(),
    "causal_top_left": lambda b, h, lq, lk: masks.causal("top_left"),
    "window": lambda b, h, lq, lk: masks.sliding_window(37),
    "window_two_sided": lambda b, h, lq, lk: masks.sliding_window(50, 20),
    "document": lambda b, h, lq, lk: masks.document(torch.arange(lk) // 61, q_offset=lk - lq),
    "document_causal": lambda b, h, lq, lk: masks.document(torch.arange(lk) // 61, q_offset=lk - lq) & masks.causal(),
    "prefix_lm": lambda b, h, lq, lk: masks.prefix_lm(70),
    "padding": lambda b, h, lq, lk: masks.padding(torch.tensor([lk, 0, lk // 3, 1][:b])),
    "padding_causal": lambda b, h, lq, lk: masks.padding(torch.tensor([lk - 5, 9][:b])) & masks.causal(),
    "from_fn_per_head": lambda b, h, lq, lk: masks.from_fn(
        lambda bb, hh, i, j: ((i - j) % (hh + 2) == 0) | (j < 3), num_heads=h
    ),
    "dense_random": lambda b, h, lq, lk: torch.rand(b, 1, lq, lk) > 0.6,
    "union": lambda b, h, lq, lk: masks.sliding_window(10) | masks.prefix_lm(20),
}


def allowed_of(mask, lq, lk):
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor):
        return mask
    return attnkit.prepare(mask, lq, lk).materialize()


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_mask_forward_and_gradients(name, dtype, spy):
    b, hq, hkv, lq, lk, d = 2, 4, 2, 300, 333, 32
    q = randn(b, hq, lq, d, dtype=dtype, requires_grad=True)
    k, v = (randn(b, hkv, lk, d, dtype=dtype, requires_grad=True) for _ in range(2))
    check_forward_and_gradients(q, k, v, MASKS[name](b, hq, lq, lk), f"{name} {dtype}")
    assert spy.counts == {"attnkit::native_forward": 1, "attnkit::native_backward": 1}


@pytest.mark.parametrize("name", ["none", "causal", "document_causal", "window", "padding"])
def test_bfloat16_keys_and_dims_in_blocks_of_32(name, spy):
    """Lk, D and Dv multiples of 32 (Dv != D), K and V broadcast over the batch: where bf16 runs on
    AMX tiles the engine transposes V for the forward and K for the backward in 32 x 32 blocks of
    registers (elsewhere the same call runs the dot products); the formula's output and gradients."""
    b, hq, hkv, lq, lk, d, dv = 2, 4, 2, 224, 256, 64, 32
    q = randn(b, hq, lq, d, dtype=torch.bfloat16, requires_grad=True)
    k = randn(1, hkv, lk, d, dtype=torch.bfloat16).expand(b, -1, -1, -1).requires_grad_()
    v = randn(1, hkv, lk, dv, dtype=torch.bfloat16).expand(b, -1, -1, -1).requires_grad_()
    check_forward_and_gradients(q, k, v, MASKS[name](b, hq, lq, lk), f"{name} blocks of 32")
    assert spy.counts == {"attnkit::native_forward": 1, "attnkit::native_backward": 1}


@pytest.mark.parametrize(
    "kind",
    ["alibi", "alibi_causal", "relative_fixed", "softcap", "sinks", "alibi_softcap_sinks", "relative_learned"],
)
@pytest.mark.parametrize("mask_name", ["causal", "window", "document", "padding"])
def test_score_modifications_forward_and_gradients(kind, mask_name, spy):
    """A bias of kv - q (fixed or learned: its band's gradient is summed along the diagonals of dS),
    soft-capping and sinks run inside the native engine, forward and backward."""
    b, hq, hkv, lq, lk, d = 2, 4, 2, 200, 200, 16
    q = randn(b, hq, lq, d, requires_grad=True)
    k, v = (randn(b, hkv, lk, d, requires_grad=True) for _ in range(2))
    slopes = bias.alibi_slopes(hq)
    table = 0.5 * torch.randn(32, hq)
    sinks = torch.randn(hq)
    alibi, alibi_causal = alibi_formula(slopes, lq, lk), alibi_formula(slopes, lq, lk, causal=True)
    ours, theirs = {
        "alibi": ({"attn_bias": bias.alibi(slopes)}, {"add": alibi}),
        "alibi_causal": ({"attn_bias": bias.alibi(slopes, causal=True)}, {"add": alibi_causal}),
        "relative_fixed": ({"attn_bias": bias.relative(table)}, {"add": relative_formula(table, lq, lk)}),
        "softcap": ({"softcap": 2.5}, {"softcap": 2.5}),
        "sinks": ({"sinks": sinks}, {"sinks": sinks.double()}),
        "alibi_softcap_sinks": (
            {"attn_bias": bias.alibi(slopes), "softcap": 4.0, "sinks": sinks},
            {"add": alibi, "softcap": 4.0, "sinks": sinks.double()},
        ),
        "relative_learned": (
            {"attn_bias": bias.relative(table.clone().requires_grad_())},
            {"add": relative_formula(table, lq, lk)},
        ),
    }[kind]
    mask = MASKS["window_two_sided" if mask_name == "window" else mask_name](b, hq, lq, lk)
    check_forward_and_gradients(q, k, v, mask, f"{kind} {mask_name}", theirs=theirs, **ours)
    assert spy.counts == {"attnkit::native_forward": 1, "attnkit::native_backward": 1}


def test_sink_and_bias_gradients_reach_their_tensors():
    """The lse's gradient (sinks) and the scores' gradient through tanh run in the native backward:
    the sink logits' own gradient equals the formula's."""
    q = randn(1, 4, 150, 16, requires_grad=True)
    k, v = (randn(1, 4, 150, 16, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, requires_grad=True)
    out = attnkit.attention(q, k, v, masks.causal(), kernel="native", sinks=sinks, softcap=3.0)
    s64 = sinks.detach().double().requires_grad_()
    gold = oracle(q.double(), k.double(), v.double(), masks.causal().materialize(150, 150), softcap=3.0, sinks=s64)
    up = torch.randn(out.shape, dtype=torch.float64)
    (got,) = torch.autograd.grad(out, sinks, up.float())
    (want,) = torch.autograd.grad(gold, s64, up)
    torch.testing.assert_close(got.double(), want, atol=1e-5 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize(
    "lq, lk, d, dv", [(1, 1, 8, 8), (7, 113, 40, 8), (113, 7, 80, 80), (1023, 1025, 8, 40), (17, 300, 128, 64)]
)
def test_awkward_sizes_and_head_dims(lq, lk, d, dv):
    """Lengths that are no multiple of any block, head dims 8-128 and Dv != D (the one-query and
    7-query calls take the engine's row path, the others its tile path)."""
    q = randn(2, 2, lq, d, requires_grad=True)
    k, v = randn(2, 1, lk, d, requires_grad=True), randn(2, 1, lk, dv, requires_grad=True)
    for mask in (None, masks.causal(), masks.sliding_window(5)):
        check_forward_and_gradients(q, k, v, mask, f"{lq}x{lk} d={d} dv={dv} {mask!r}")


@pytest.mark.parametrize("lq", [1, 3, 8, 9])
@pytest.mark.parametrize(
    "name", ["none", "causal", "window", "document_causal", "padding", "from_fn_per_head", "dense_random", "union"]
)
def test_few_query_rows_forward_and_gradients(lq, name, spy):
    """Calls of at most 8 queries (decoding) take the engine's row path (one item per sequence,
    K/V head and group of query heads; 9 takes the tile path): the formula's output and lse, and
    gradients through the tile path's backward, for masks shared by the heads and per head."""
    b, hq, hkv, lk, d = 4, 8, 2, 333, 24
    q = randn(b, hq, lq, d, requires_grad=True)
    k, v = (randn(b, hkv, lk, d, requires_grad=True) for _ in range(2))
    check_forward_and_gradients(q, k, v, MASKS[name](b, hq, lq, lk), f"{name} lq={lq}", small=lq <= 8)
    assert spy.counts == {"attnkit::native_forward": 1, "attnkit::native_backward": 1}


@pytest.mark.parametrize(
    "softcap, spread",
    [
        (50.0, 1.0),  # every |score| far below 0.625 softcap: the folded polynomial alone
        (2.5, 3.0),  # scores on both sides of 0.625 softcap in one vector: polynomial and exp blended per lane
        (0.01, 1.0),  # nearly every score past it: the exp form
        (1e4, 1.0),  # (scale / softcap)^10 underflows float32: not folded (tanh of s * scale / cap)
    ],
)
@pytest.mark.parametrize("lq", [1, 97])
def test_softcap_in_every_regime_of_its_tanh_meets_the_oracle(softcap, spread, lq):
    """softcap * tanh(s * scale / softcap) by the engine's polynomial with scale / softcap folded into its
    coefficients, by the exp form, and unfolded: each against the float64 formula, forward and gradients,
    the decode path (one query) and the tile path."""
    q = (randn(2, 4, lq, 16) * spread).requires_grad_()
    k, v = (randn(2, 2, 150, 16, requires_grad=True) for _ in range(2))
    mask = masks.padding(torch.tensor([150, 41])) & masks.causal()
    check_forward_and_gradients(q, k, v, mask, f"softcap {softcap}", theirs={"softcap": softcap}, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["alibi", "softcap", "relative_learned", "sinks"])
def test_few_query_rows_with_score_modifications(kind, dtype):
    b, hq, hkv, lq, lk, d = 3, 4, 4, 2, 150, 16
    q = randn(b, hq, lq, d, dtype=dtype, requires_grad=True)
    k, v = (randn(b, hkv, lk, d, dtype=dtype, requires_grad=True) for _ in range(2))
    slopes, table, sinks = bias.alibi_slopes(hq), 0.5 * torch.randn(32, hq), torch.randn(hq)
    ours, theirs = {
        "alibi": ({"attn_bias": bias.alibi(slopes)}, {"add": alibi_formula(slopes, lq, lk)}),
        "softcap": ({"softcap": 2.5}, {"softcap": 2.5}),
        "relative_learned": (
            {"attn_bias": bias.relative(table.clone().requires_grad_())},
            {"add": relative_formula(table, lq, lk)},
        ),
        "sinks": ({"sinks": sinks}, {"sinks": sinks.double()}),
    }[kind]
    mask = masks.padding(torch.tensor([150, 7, 0])) & masks.causal()
    check_forward_and_gradients(q, k, v, mask, f"{kind} {dtype}", theirs=theirs, small=True, **ours)


@pytest.mark.parametrize("lq, hkv", [(1, 4), (1, 2), (3, 2)])
@pytest.mark.parametrize("kind", ["plain", "softcap", "alibi", "sinks"])
@pytest.mark.parametrize("mask_name", ["none", "padding", "causal_hiding_nothing"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_query_rows_over_one_run_of_keys(lq, hkv, kind, mask_name, dtype):
    """float32 or bfloat16 rows (widened in the registers) of a multiple of 16 dims whose keys are one
    run (no mask, padding, a causal mask that hides nothing): the row path reads K and V rows in place
    with no list of keys; the formula's output, lse and gradients with each score modification,
    sequences of every fill (one empty), over 333 keys (steps of 512 keys cut short) and 1100 (three
    steps)."""
    b, hq, d = 4, 4, 64
    for lk in (333, 1100):
        mask = {
            "none": None,
            "padding": masks.padding(torch.tensor([lk, 0, lk // 3, 1])),
            "causal_hiding_nothing": masks.causal(),
        }[mask_name]
        if mask_name == "causal_hiding_nothing" and lq > 1:
            mask = masks.causal() & masks.padding(torch.tensor([lk - 5, lk, 9, 200]))  # the run cut per sequence
        q = randn(b, hq, lq, d, dtype=dtype, requires_grad=True)
        k, v = (randn(b, hkv, lk, d, dtype=dtype, requires_grad=True) for _ in range(2))
        slopes, sinks = bias.alibi_slopes(hq), torch.randn(hq)
        ours, theirs = {
            "plain": ({}, {}),
            "softcap": ({"softcap": 2.5}, {"softcap": 2.5}),
            "alibi": ({"attn_bias": bias.alibi(slopes)}, {"add": alibi_formula(slopes, lq, lk)}),
            "sinks": ({"sinks": sinks}, {"sinks": sinks.double()}),
        }[kind]
        check_forward_and_gradients(
            q, k, v, mask, f"{kind} {mask_name} lq={lq} lk={lk}", theirs=theirs, small=True, **ours
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_query_rows_over_one_run_never_read_past_each_length(dtype):
    """The run path (keys read in place up to each sequence's length) reads no key past it: NaN and
    inf stored there leave the output and lse bit for bit as they were, and each sequence's output
    equals the same sequence computed alone. bfloat16 rows are widened exactly and summed as float32
    rows are: the output is the float32 call's on the same values, rounded once."""
    lengths = torch.tensor([1100, 0, 333, 1])
    q, k, v = randn(4, 8, 1, 64, dtype=dtype), randn(4, 2, 1100, 64, dtype=dtype), randn(4, 2, 1100, 64, dtype=dtype)
    clean = attnkit.attention(q, k, v, masks.padding(lengths), kernel="native", return_lse=True)
    wide = attnkit.attention(q.float(), k.float(), v.float(), masks.padding(lengths), kernel="native", return_lse=True)
    assert torch.equal(clean[0], wide[0].to(dtype)) and torch.equal(clean[1], wide[1])
    pk, pv = k.clone(), v.clone()
    for i, n in enumerate(lengths.tolist()):
        pk[i, :, n:], pv[i, :, n:] = float("nan"), float("inf")
    poisoned = attnkit.attention(q, pk, pv, masks.padding(lengths), kernel="native", return_lse=True)
    for a, b in zip(clean, poisoned):
        assert torch.equal(a, b)
    for i, n in enumerate(lengths.tolist()):
        if n == 0:
            assert (clean[0][i] == 0).all() and (clean[1][i] == float("-inf")).all()
            continue
        alone = attnkit.attention(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], kernel="native")
        assert torch.equal(clean[0][i : i + 1], alone)


def test_few_query_rows_never_read_hidden_keys():
    """The row path reads no key that no query of the call may see: NaN and inf stored past each
    sequence's length and in hidden blocks leave the output and lse bit for bit as they were."""
    mask = masks.padding(torch.tensor([300, 41, 0, 129])) & masks.from_fn(lambda b, h, i, j: (j < 64) | (j >= 192))
    q, k, v = randn(4, 4, 2, 32), randn(4, 2, 300, 32), randn(4, 2, 300, 32)
    clean = attnkit.attention(q, k, v, mask, kernel="native", return_lse=True)
    pk, pv = k.clone(), v.clone()
    pk[1, :, 41:], pv[1, :, 41:] = float("nan"), float("inf")
    pk[3, :, 129:], pv[3, :, 129:] = float("inf"), float("nan")
    pk[:, :, 64:192], pv[:, :, 64:192] = float("nan"), float("nan")
    pk[2], pv[2] = float("nan"), float("nan")
    poisoned = attnkit.attention(q, pk, pv, mask, kernel="native", return_lse=True)
    for a, b_ in zip(clean, poisoned):
        assert torch.equal(a, b_)
    assert (clean[0][2] == 0).all() and torch.isneginf(clean[1][2]).all()


def test_few_query_rows_split_between_threads_by_cost():
    """The row path splits its items (sequence, K/V head) between the threads by the keys each
    reads, in one fixed order: sequences of very different lengths (one empty) give the same
    answer, bit for bit, on 1, 2 and 3 threads (each item is computed whole by one thread), and
    the formula's (the float64 oracle)."""
    lengths = torch.tensor([700, 3, 0, 511, 64])
    q, k, v = randn(5, 6, 1, 32), randn(5, 6, 700, 32), randn(5, 6, 700, 32)
    mask = masks.padding(lengths)
    before = torch.get_num_threads()
    try:
        answers = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            answers.append(attnkit.attention(q, k, v, mask, kernel="native", return_lse=True))
    finally:
        torch.set_num_threads(before)
    for out, lse in answers[1:]:
        assert torch.equal(out, answers[0][0]) and torch.equal(lse, answers[0][1])
    gold, naive = gold_and_naive(q, k, v, allowed_of(mask, 1, 700))
    assert_oracle(answers[0][0], gold, naive)
    assert (answers[0][0][2] == 0).all() and torch.isneginf(answers[0][1][2]).all()


def test_grouped_heads_equal_repeated_kv():
    q = randn(2, 8, 200, 32)
    k, v = randn(2, 2, 200, 32), randn(2, 2, 200, 32)
    for mask in (None, masks.causal(), masks.document(torch.arange(200) // 50)):
        grouped = attnkit.attention(q, k, v, mask, kernel="native")
        repeated = attnkit.attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), mask, kernel="native")
        torch.testing.assert_close(grouped, repeated, atol=1e-6, rtol=1e-5)


def test_strided_transposed_and_expanded_inputs_equal_contiguous():
    """(B, L, H, D) views, expanded K/V heads and a strided last dimension give the contiguous
    result (the last one is copied: the engine reads rows as memory)."""
    base = randn(2, 160, 4, 64)  # (B, L, H, D)
    q = base.transpose(1, 2)  # (B, H, L, D), non-contiguous
    kv = randn(2, 1, 160, 64).expand(2, 4, 160, 64)
    strided = randn(2, 4, 160, 128)[..., ::2]
    mask = masks.sliding_window(40)
    for args in ((q, kv, kv), (strided, q, kv), (q, strided, strided)):
        got = attnkit.attention(*args, mask, kernel="native")
        want = attnkit.attention(*(t.contiguous() for t in args), mask, kernel="native")
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        gold, naive = gold_and_naive(*args, allowed_of(mask, 160, 160))
        assert_oracle(got, gold, naive)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("first, width", [(0, 1), (-3, 7), (5, 18), (-40, 9), (-17, 40)])
def test_a_narrow_band_inside_each_step_is_the_formula(first, width, dtype):
    """A narrow band of keys per query (key j for query i where first <= j - i < first + width): each
    step of 32 rows uses a few keys in the middle of its 64, from offsets that are not multiples of
    anything, with unused keys at either end. The forward and the gradients are the formula's,
    keys used by other rows of the block read in full; junk in the keys no query uses at all never
    reaches the output."""
    lq, lk = 200, 230
    mask = masks.from_fn(lambda b, h, i, j: (j - i >= first) & (j - i < first + width))
    q = randn(1, 2, lq, 16, dtype=dtype, requires_grad=True)
    k, v = (randn(1, 2, lk, 16, dtype=dtype, requires_grad=True) for _ in range(2))
    check_forward_and_gradients(q, k, v, mask, f"band {first}+{width} {dtype}", small=True)
    unused = ~allowed_of(mask, lq, lk).any(dim=2)[0, 0]  # (Lk,): keys no query attends
    with torch.no_grad():
        pk, pv = k.detach().clone(), v.detach().clone()
        pk[:, :, unused], pv[:, :, unused] = float("nan"), float("inf")
        clean = attnkit.attention(q, k, v, mask, kernel="native")
        assert torch.equal(attnkit.attention(q, pk, pv, mask, kernel="native"), clean)


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("d", [16, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_junk_in_unread_keys_and_queries_never_leaks(dtype, d, softcap):
    """NaN and inf in keys past a sequence's length, in keys no query may attend and in queries that
    attend no key: the output and the gradients are those of the clean inputs, bit for bit (bf16
    on AMX tiles: K^T read in place or copied with such keys zeroed, V read in place; a softcap's
    kept tanh of a hidden score)."""
    mask = masks.padding(torch.tensor([150, 41])) & masks.from_fn(lambda b, h, i, j: (j % 7 != 3) & (i % 9 != 2))
    q, k, v = (randn(2, 2, 200, d, dtype=dtype) for _ in range(3))
    dout = randn(2, 2, 200, d, dtype=dtype)

    def run(q, k, v):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = attnkit.attention(q, k, v, mask, kernel="native", softcap=softcap)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    clean = run(q, k, v)
    pq, pk, pv = q.clone(), k.clone(), v.clone()
    pk[0, :, 150:], pv[0, :, 150:] = float("nan"), float("inf")
    pk[1, :, 41:], pv[1, :, 41:] = float("inf"), float("nan")
    pk[:, :, 3::7], pv[:, :, 3::7] = float("nan"), float("nan")
    pq[:, :, 2::9] = float("nan")
    poisoned = run(pq, pk, pv)
    for a, b in zip(clean[:2], poisoned[:2]):
        assert torch.equal(a, b)
    used = allowed_of(mask, 200, 200).any(dim=2)[:, :, :, None]  # (B, 1, Lk, 1): keys some query uses
    for a, b in zip(clean[2:], poisoned[2:]):
        assert torch.equal(torch.where(used, a, 0.0), torch.where(used, b, 0.0))
        assert (b.masked_select(~used.expand_as(b)) == 0).all()


def test_rows_that_see_no_key_give_zeros_and_minus_infinity():
    q = randn(2, 2, 100, 16, requires_grad=True)
    k, v = (randn(2, 2, 100, 16, requires_grad=True) for _ in range(2))
    mask = masks.padding(torch.tensor([0, 60])) & masks.causal("top_left")
    out, lse = attnkit.attention(q, k, v, mask, kernel="native", return_lse=True)
    assert (out[0] == 0).all() and torch.isinf(lse[0]).all() and (lse[0] < 0).all()
    assert torch.isfinite(lse[1]).all()
    (out.sum() + lse[1].sum()).backward()
    assert (q.grad[0] == 0).all() and (k.grad[0] == 0).all() and (v.grad[0] == 0).all()
    assert torch.isfinite(q.grad).all()


def test_lse_and_its_gradient_equal_the_formula():
    q = randn(1, 4, 260, 32, requires_grad=True)
    k, v = (randn(1, 2, 300, 32, requires_grad=True) for _ in range(2))
    mask = masks.sliding_window(70)
    out, lse = attnkit.attention(q, k, v, mask, kernel="native", return_lse=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = (q64 @ k64.repeat_interleave(2, 1).transpose(-2, -1) * 32**-0.5).masked_fill(
        ~allowed_of(mask, 260, 300), float("-inf")
    )
    lse64 = s.logsumexp(-1)
    assert (lse.double() - lse64).abs().max() < 1e-5
    up_o, up_l = torch.randn(out.shape), torch.randn(lse.shape)
    got = torch.autograd.grad((out * up_o).sum() + (lse * up_l).sum(), (q, k, v))
    gold = naive_attention(q64, k64, v64, allowed_of(mask, 260, 300))[0]
    want = torch.autograd.grad((gold * up_o.double()).sum() + (lse64 * up_l.double()).sum(), (q64, k64, v64))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=2e-5 * w.abs().max().item(), rtol=0)


@pytest.mark.parametrize("scale", [-0.3, 1e-4, 100.0])
def test_large_logits_negative_and_tiny_scales(scale):
    q = randn(1, 2, 150, 16) * (100 if scale == 100.0 else 1)
    k, v = randn(1, 2, 150, 16) * (100 if scale == 100.0 else 1), randn(1, 2, 150, 16)
    mask = masks.causal()
    out = attnkit.attention(q, k, v, mask, kernel="native", scale=scale)
    gold, naive = gold_and_naive(q, k, v, allowed_of(mask, 150, 150), scale=scale)
    assert_oracle(out, gold, naive)


def test_bfloat16_near_its_largest_values_stays_finite():
    q, k, v = (randn(1, 2, 130, 16, dtype=torch.bfloat16) * 1e5 for _ in range(3))
    out = attnkit.attention(q, k, v, masks.causal(), kernel="native")
    assert torch.isfinite(out).all()


def test_same_inputs_give_bit_identical_outputs_and_gradients():
    q = randn(2, 4, 300, 32, requires_grad=True)
    k, v = (randn(2, 4, 300, 32, requires_grad=True) for _ in range(2))

    def run():
        out = attnkit.attention(q, k, v, masks.document(torch.arange(300) // 90), kernel="native")
        return (out, *torch.autograd.grad(out.sum(), (q, k, v)))

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mask_name", ["document_causal", "window"])
def test_a_large_float32_output_written_past_the_caches_equals_each_head_alone(mask_name):
    """A float32 output of 2^21 values or more is written with stores that bypass the caches
    (forward.h's streams()); one head of it alone is a small output written as usual. Both are the
    same products and sums, so the two agree bit for bit, and the first document's rows meet the
    float64 oracle."""
    b, h, lq, d = 1, 8, 4096, 64
    assert b * h * lq * d >= 1 << 21  # the size from which forward.h streams its output
    q, k, v = (randn(b, h, lq, d) for _ in range(3))
    mask = {
        "document_causal": masks.document(torch.arange(lq) // 512) & masks.causal(),
        "window": masks.sliding_window(100),
    }[mask_name]
    out = attnkit.attention(q, k, v, mask, kernel="native")
    for head in range(h):
        one = attnkit.attention(
            q[:, head : head + 1], k[:, head : head + 1], v[:, head : head + 1], mask, kernel="native"
        )
        assert torch.equal(out[:, head : head + 1], one), f"head {head}"
    first = slice(0, 300)
    allowed = allowed_of(mask, lq, lq)[..., first, first]
    q64, k64, v64 = (t[:, :, first].double() for t in (q, k, v))
    gold = oracle(q64, k64, v64, allowed)
    naive = oracle(q[:, :, first], k[:, :, first], v[:, :, first], allowed)
    assert_oracle(out[:, :, first], gold, naive, what=f"{mask_name}, rows 0-299 of a streamed output")


def test_one_and_two_threads_agree():
    """Different thread counts split dK/dV differently: equal within the oracle rule, not bit for bit."""
    q = randn(1, 2, 400, 32, requires_grad=True)
    k, v = (randn(1, 2, 400, 32, requires_grad=True) for _ in range(2))
    mask = masks.sliding_window(100)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = attnkit.attention(q, k, v, mask, kernel="native")
            results.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_inference_mode_no_grad_and_compile():
    q, k, v = (randn(1, 4, 256, 32) for _ in range(3))
    prepared = attnkit.prepare(masks.sliding_window(64), 256, 256)
    eager = attnkit.attention(q, k, v, prepared, kernel="native")
    with torch.inference_mode():
        assert torch.equal(attnkit.attention(q, k, v, prepared, kernel="native"), eager)
    with torch.no_grad():
        assert torch.equal(attnkit.attention(q, k, v, prepared, kernel="native"), eager)
    compiled = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, prepared), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), eager, atol=1e-6, rtol=1e-5)


def test_explain_names_the_kernel_its_build_and_why_not():
    q = randn(1, 2, 64, 16)
    plan = attnkit.explain(q, q, q, masks.sliding_window(8), kernel="tiled")
    assert plan.kernel == "native" and native_build.describe(False) in str(
        attnkit.explain(q, q, q, masks.sliding_window(8), return_lse=True)
    )
    dropout = attnkit.explain(q, q, q, masks.sliding_window(8), dropout_p=0.1)
    assert dropout.kernel == "math" and "no dropout (dropout_p=0.1)" in dropout.rejected["native"]
    one = attnkit.explain(q[:, :, :1], q, q, masks.sliding_window(8))
    assert "1 queries: it computes 32 rows at a time" in " ".join(one.rejected["native"])
