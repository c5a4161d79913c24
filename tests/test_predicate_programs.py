"""``from_fn`` predicates as programs on the native engine (attnkit/masks/_program.py, evaluated by
kernels/native/csrc/predicate.h): each result bit for bit against the predicate evaluated by torch
one pair at a time (``create_mask``: torch.vmap over every pair, FlexAttention's definition), on
attention-gym's catalogue, on the integer semantics torch has (wrapping dtypes, floor division of
negative numbers, shifts past the width, a Python scalar converted to a tensor's dtype), on what
the language does not hold (torch's path answers), and on the engine's checks of a program."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _oracle import engine_evaluations  # tests/_oracle.py

import attnkit
from attnkit import _cache, masks
from attnkit.kernels.native import build
from attnkit.masks import _from_fn, _program
from attnkit.masks._base import Blocks
from attnkit.masks._codes import EMPTY, FULL, PARTIAL

flex_module = pytest.importorskip("torch.nn.attention.flex_attention")
pytestmark = pytest.mark.skipif(not build.available(), reason="the native engine does not run here")


@pytest.fixture
def native_everywhere():
    """Every evaluation of a predicate, however small, on the engine; and how many it answered."""
    with engine_evaluations() as answered:
        yield answered


def truth(fn, b, h, lq, lk):
    return flex_module.create_mask(fn, b, h, lq, lk, device="cpu")


def on_engine(fn, b, h, lq, lk, mode=0):
    """``fn`` over every (b, h, q, kv) as one call of the engine: (B * H, lq, lk)."""
    bs = torch.arange(b).repeat_interleave(h).view(-1, 1, 1)
    hs = torch.arange(h).repeat(b).view(-1, 1, 1)
    q, kv = torch.arange(lq).view(1, -1, 1), torch.arange(lk).view(1, 1, -1)
    program = _program.trace(fn, bs, hs, q, kv)
    assert program is not None, "the predicate is not a program"
    return _program.evaluate(program, (bs, hs, q, kv), (b * h, lq, lk), mode)


def codes_of_pairs(allowed, bq, bk):
    lq, lk = allowed.shape[-2:]
    pad = (0, -lk % bk, 0, -lq % bq)

    def tiles(fill):
        return torch.nn.functional.pad(allowed, pad, value=fill).unflatten(-1, (-1, bk)).unflatten(2, (-1, bq))

    full, some = tiles(True).all(-1).all(-2), tiles(False).any(-1).any(-2)
    return torch.where(full, FULL, torch.where(some, PARTIAL, EMPTY)).to(torch.int8)


def gym():
    gym_module = pytest.importorskip("attn_gym")
    del gym_module
    from _gym import catalogue

    return catalogue


GYM = [
    "causal", "sliding_window", "prefix_lm", "document", "packed_causal_document", "dilated_sliding_window",
    "global_sliding_window", "natten", "tiled_natten", "morton_natten", "block_diffusion", "vision_cross_attention",
    "jetspec_training", "jetspec_tree_causal", "shared_prefix", "sta_2d", "sta_3d", "svg_spatial_head",
    "svg_temporal_head", "batchify", "vsa",
]  # fmt: skip


def test_the_catalogue_is_covered():
    assert sorted(GYM) == sorted(gym()(256))


@pytest.mark.parametrize("name", GYM)
def test_every_attention_gym_mask_on_the_engine_equals_pair_by_pair(name, native_everywhere):
    """Each mask of the catalogue (at 256 and 320 tokens: a ragged last block) prepared with every
    evaluation on the engine: the block map and every bit equal torch's per-pair answer, and the
    engine answered (VSA's predicate reduces over one pair's top-k list: not a program, torch's path)."""
    for length in (256, 320):
        try:
            made = gym()(length)[name]()
        except AssertionError:  # attention-gym's own check: this mask's canvas does not divide 320
            continue
        fn, lq, lk = made[:3]
        b, h = (made[3], made[4]) if len(made) > 3 else (None, None)
        allowed = truth(fn, b or 1, h or 1, lq, lk)
        mask = masks.from_fn(fn, batch_size=b, num_heads=h)
        assert torch.equal(mask.block_map(lq, lk, 128, 64).expand(allowed.shape[0], allowed.shape[1], -1, -1),
                           codes_of_pairs(allowed, 128, 64))  # fmt: skip
        prepared = attnkit.prepare(masks.from_fn(fn, batch_size=b, num_heads=h), lq, lk, block_size=(128, 64))
        assert torch.equal(prepared.materialize().expand_as(allowed), allowed)
        if name == "vsa":
            assert not any(native_everywhere)
        else:
            assert native_everywhere and all(native_everywhere), native_everywhere
            assert torch.equal(on_engine(fn, b or 1, h or 1, lq, lk), allowed.flatten(0, 1))


@pytest.mark.parametrize("y", [13, 64, 200])
def test_packed_bits_and_each_tiles_all_and_any_agree_with_the_bools(y):
    docs = torch.tensor([0] * 70 + [1] * 90 + [2] * 40)

    def fn(b, h, q, kv):
        return ((docs[q] == docs[kv]) & (kv <= q + h)) | (kv % 29 == b)

    bools = on_engine(fn, 2, 3, 200, y)
    assert torch.equal(bools, truth(fn, 2, 3, 200, y).flatten(0, 1))
    packed = on_engine(fn, 2, 3, 200, y, mode=1)
    assert torch.equal(packed, torch.from_numpy(np.packbits(bools.numpy(), axis=-1, bitorder="little")))
    seen = on_engine(fn, 2, 3, 200, y, mode=2)
    assert torch.equal(seen, bools.flatten(1).any(1).to(torch.uint8) | (~bools.flatten(1).all(1)).to(torch.uint8) << 1)


I32 = torch.tensor([2**31 - 5, -(2**31) + 3, 7, -9] * 16, dtype=torch.int32)
U8 = torch.arange(64, dtype=torch.uint8) * 5
I8 = (torch.arange(64) * 7 - 200).to(torch.int8)
REL = torch.randint(-5, 5, (3, 127), generator=torch.Generator().manual_seed(0))
CUBE = torch.randint(0, 4, (2, 3, 64), generator=torch.Generator().manual_seed(1))
SPANS = torch.tensor([[0, 20], [10, 64]])
FLAGS = torch.arange(64) % 5 == 0

SEMANTICS = {
    "int32 table values wrap when added to": lambda b, h, q, kv: (I32[q] + I32[kv]) > 0,
    "int32 times a scalar wraps in int32": lambda b, h, q, kv: (I32[kv] * 3) < q,
    "uint8 arithmetic wraps at 256": lambda b, h, q, kv: (U8[q] + 200) < U8[kv],
    "int8 negation wraps": lambda b, h, q, kv: -I8[q] > I8[kv],
    "a scalar past int32 converted to int32": lambda b, h, q, kv: I32[q] < 2**40 + kv,
    "shifts past the width": lambda b, h, q, kv: ((q << 70) == 0) & ((-kv >> 70) == -1) | (kv < 3),
    "int32 shifts past 32": lambda b, h, q, kv: (I32[q] >> 40) == (I32[kv] << 33),
    "floor division and remainder of negatives by a tensor": lambda b, h, q, kv: (
        ((q - 30) // (kv % 7 - 9)) > ((kv - 40) % (q % 5 - 6))
    ),
    "floor division by a constant that is no power of two": lambda b, h, q, kv: (q - 31) // 7 == (kv - 17) // 7,
    "truncating division and fmod": lambda b, h, q, kv: (
        torch.div(q - 30, 7, rounding_mode="trunc") == torch.fmod(kv - 30, 5)
    ),
    "where with Python scalars, clamp with min over max": lambda b, h, q, kv: (
        torch.where(q > kv, 3, -2) > (kv - q).clamp(5, 1)
    ),
    "bool arithmetic": lambda b, h, q, kv: ((q > kv) + (q < 5)) & ~(kv == 3),
    "abs, sign, minimum and maximum": lambda b, h, q, kv: (
        torch.maximum((q - kv).abs(), (q - 9).sign()) < torch.minimum(q, kv + 4)
    ),
    "logical operations of integers": lambda b, h, q, kv: torch.logical_xor(q % 3, kv % 2) | torch.logical_not(q),
    "bit operations and not": lambda b, h, q, kv: ((q ^ kv) & ~(q | 4)) < 9,
    "int64 products that wrap": lambda b, h, q, kv: (q * 2**62 + kv * 2**61) > 0,
    "large values keep int64 lanes": lambda b, h, q, kv: (q * 2**40) // 2**39 == kv * 2,
    "casts that wrap": lambda b, h, q, kv: ((q * 2**30 + kv).int() > 0) & (kv.to(torch.uint8) < 200),
    "a 2-d table at a negative index": lambda b, h, q, kv: REL[h, q - kv - 1] > 0,
    "a 3-d table": lambda b, h, q, kv: CUBE[b, h, kv] == q % 4,
    "a row of a table, indexed again": lambda b, h, q, kv: (q >= SPANS[kv // 32][0]) & (q < SPANS[kv // 32][1]),
    "a bool table": lambda b, h, q, kv: FLAGS[q] | FLAGS[kv] | (q == kv),
    "a constant made from an index": lambda b, h, q, kv: q.new_zeros((), dtype=torch.bool) | (torch.ones_like(q) == kv),
}


@pytest.mark.parametrize("name", list(SEMANTICS))
def test_integer_semantics_are_torchs(name):
    fn = SEMANTICS[name]
    assert torch.equal(on_engine(fn, 2, 3, 64, 64), truth(fn, 2, 3, 64, 64).flatten(0, 1))


OUTSIDE = {
    "float arithmetic": lambda b, h, q, kv: q.float() / 2 > kv,
    "true division": lambda b, h, q, kv: q / 3 > kv,
    "a reduction": lambda b, h, q, kv: torch.any(kv == torch.tensor([3, 5])) | (q >= kv),
    "a host read": lambda b, h, q, kv: q >= kv if bool(q > 1000) else q < kv,
    "an in-place write": lambda b, h, q, kv: q.clone().add_(1) > kv,
    "reading a shape": lambda b, h, q, kv: q >= kv + q.shape[-1],
    "indexing a computed tensor": lambda b, h, q, kv: (q + kv)[..., None][..., 0] > 3,
    "a constant answer": lambda b, h, q, kv: torch.tensor(True),
    "a float table": lambda b, h, q, kv: torch.linspace(0, 1, 64)[q] > 0.5,
}


@pytest.mark.parametrize("name", list(OUTSIDE))
def test_what_the_language_does_not_hold_is_not_a_program_and_torch_answers(name, native_everywhere):
    fn = OUTSIDE[name]
    z = torch.zeros((), dtype=torch.int64)
    assert _program.trace(fn, z, z, z, z) is None
    try:
        allowed = truth(fn, 1, 1, 64, 64)
    except Exception:  # noqa: BLE001 - not a FlexAttention predicate either: nothing to compare
        return
    assert torch.equal(attnkit.prepare(masks.from_fn(fn), 64, 64, block_size=(16, 16)).materialize(), allowed)
    assert not any(native_everywhere)


@pytest.mark.parametrize(
    "fn",
    [
        lambda b, h, q, kv: torch.arange(10)[q] >= kv,  # an index past the table (from q = 10 on)
        lambda b, h, q, kv: (q // (kv - 5)) > 0,  # a division by zero (at kv = 5)
        lambda b, h, q, kv: (q << (kv - 5)) > 0,  # a negative shift (below kv = 5)
    ],
    ids=["index past a table", "division by zero", "negative shift"],
)
def test_a_pair_the_engine_cannot_compute_falls_to_torch(fn, monkeypatch):
    """The program traces (its first pair is fine) but some pair cannot be computed: the engine says
    so and the mask is made by torch's path, which raises or answers as it does without the engine."""
    z = torch.zeros((), dtype=torch.int64)
    program = _program.trace(fn, z, z, z, z)
    assert program is not None
    q, kv = torch.arange(64).view(1, -1, 1), torch.arange(64).view(1, 1, -1)
    assert _program.evaluate(program, (z, z, q, kv), (1, 64, 64), 0) is None
    answers = []
    for native_from in (0, 1 << 62):
        monkeypatch.setattr(_from_fn, "NATIVE_FROM", native_from)
        _cache.clear()
        try:
            answers.append(masks.from_fn(fn).block_map(64, 64, 16, 16))
        except Exception as err:  # noqa: BLE001 - torch's own error: the same with and without the engine
            answers.append(type(err))
    assert answers[0] == answers[1] if isinstance(answers[0], type) else torch.equal(*answers)


def test_a_captured_table_is_read_as_it_is_now(native_everywhere):
    """The program keeps the predicate's own tensor: written in place, the next mask reads the new
    values (the value key changes with them, so no cache answers either)."""
    docs = torch.tensor([0] * 100 + [1] * 156)
    mask = masks.from_fn(lambda b, h, q, kv: docs[q] == docs[kv])
    first = attnkit.prepare(mask, 256, 256).materialize()
    docs[:50] = 2
    second = attnkit.prepare(mask, 256, 256).materialize()
    assert torch.equal(first, truth(lambda b, h, q, kv: (q < 100) == (kv < 100), 1, 1, 256, 256))
    assert torch.equal(second, truth(lambda b, h, q, kv: docs[q] == docs[kv], 1, 1, 256, 256))
    assert all(native_everywhere)


def test_offsets_per_sequence_and_combinations_with_other_masks(native_everywhere):
    offsets = torch.tensor([0, 40])
    mask = masks.from_fn(lambda b, h, q, kv: (q - kv).abs() % 3 == 0, batch_size=2, q_offset=offsets, kv_offset=offsets)
    rows = mask._codes_by_rows(Blocks(150, 150, 32, 32))
    assert torch.equal(mask._codes_by_ranges(Blocks(150, 150, 32, 32)), rows.expand(2, 1, -1, -1))
    i, j = torch.arange(150).view(-1, 1), torch.arange(150).view(1, -1)
    combined = attnkit.prepare(mask & masks.causal(), 150, 150, block_size=(32, 32)).materialize()
    assert torch.equal(combined, (((i - j).abs() % 3 == 0) & (i >= j)).expand(2, 1, -1, -1))
    assert any(native_everywhere)


def test_the_engine_checks_the_program_it_is_given():
    ones = [torch.zeros(1, 1, 1, dtype=torch.int64)] * 2
    run = torch.ops.attnkit.native_predicate
    good = torch.tensor([[0, 5, 0, -1, -1, -1], [0, 5, 1, -1, -1, -1], [13, 0, 0, 1, -1, -1]])
    assert run(good, ones, [], [1, 2, 3], 0).shape == (1, 2, 3)
    for code, words in [
        ([[0, 5, 0, -1, -1, -1], [13, 0, 0, 2, -1, -1]], "reads slot"),  # an operand not yet computed
        ([[99, 5, 0, -1, -1, -1]], "has op"),
        ([[0, 5, 7, -1, -1, -1]], "input"),
        ([[0, 5, 0, -1, -1, -1], [28, 5, 0, 0, -1, -1]], "table"),
    ]:
        with pytest.raises(RuntimeError, match=words):
            run(torch.tensor(code), ones, [], [1, 2, 3], 0)
    with pytest.raises(RuntimeError, match="mode"):
        run(good, ones, [], [1, 2, 3], 3)
    with pytest.raises(RuntimeError):
        run(good, [torch.zeros(2, 1, 1, dtype=torch.int64)] * 2, [], [3, 2, 3], 0)  # does not broadcast
    load = torch.tensor([[0, 5, 0, -1, -1, -1], [28, 5, 0, 0, -1, -1]])
    with pytest.raises(RuntimeError, match="tables must be"):
        run(load, ones, [torch.zeros(4, dtype=torch.int32)], [1, 2, 3], 0)
    table = [torch.arange(4, dtype=torch.int64)]
    for mode in (0, 1, 2):  # the operator's registration: its fake shapes, schema and dispatch
        torch.library.opcheck(torch.ops.attnkit.native_predicate, (load, ones, table, [1, 2, 3], mode))


def test_a_torch_block_mask_lists_its_blocks_by_key_block_as_torch_would():
    """attnkit's BlockMask fills the lists by key block from its codes (torch's from_kv_blocks computes
    them by a dense round trip): the same tensors."""
    from torch.nn.attention.flex_attention import BlockMask

    from attnkit.masks._lists import to_torch_block_mask

    for mask in (masks.causal(), masks.sliding_window(100), masks.document(torch.tensor([[0] * 300 + [1] * 200]))):
        codes = mask.block_map(500, 500, 128, 64)
        for separate in (True, False):
            ours = to_torch_block_mask(codes, (128, 64), 500, 500, separate_full_blocks=separate)
            kv = (ours.kv_num_blocks, ours.kv_indices, ours.full_kv_num_blocks, ours.full_kv_indices)
            theirs = BlockMask.from_kv_blocks(*kv, BLOCK_SIZE=(128, 64), seq_lengths=(500, 500))
            for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
                a, b = getattr(ours, name), getattr(theirs, name)
                assert (a is None and b is None) or torch.equal(a, b), name


def test_a_constant_that_changes_nothing_is_left_out():
    """``or_masks`` starts from ``False`` and ``and_masks`` from ``True``: ``x | False`` and
    ``x & True`` are ``x`` (no instruction), and the answer is the same."""
    z = torch.zeros((), dtype=torch.int64)

    def counted(fn):
        return _program.trace(fn, z, z, z, z).code.shape[0]

    def plain(b, h, q, kv):
        return q >= kv

    for fn in (
        lambda b, h, q, kv: q.new_zeros((), dtype=torch.bool) | (q >= kv),
        lambda b, h, q, kv: (q >= kv) & torch.ones_like(q, dtype=torch.bool),
        lambda b, h, q, kv: torch.logical_or(q >= kv, torch.tensor(False)) ^ False,
    ):
        assert counted(fn) == counted(plain)
        assert torch.equal(on_engine(fn, 1, 2, 40, 30), truth(fn, 1, 2, 40, 30).flatten(0, 1))
    keeps = lambda b, h, q, kv: (q >= kv) | (kv == kv)  # noqa: E731 - a value per pair, not a constant
    assert counted(keeps) > counted(plain)
