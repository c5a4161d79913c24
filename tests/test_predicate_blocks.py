"""Block maps of predicate masks (``masks.from_fn``, ``flex.create_block_mask``) from index ranges
(attnkit/masks/_intervals.py) against the predicate evaluated one pair at a time: torch's own
``create_mask`` (torch.vmap over every pair, FlexAttention's definition), reduced block by block
here. Bit for bit: every block's code (empty / partial / full) is exact."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.masks import _from_fn, _program
from attnkit.masks._base import Blocks
from attnkit.masks._codes import EMPTY, FULL, PARTIAL
from attnkit.masks._from_fn import FromFn

flex_module = pytest.importorskip("torch.nn.attention.flex_attention")


def codes_of_pairs(allowed: torch.Tensor, bq: int, bk: int) -> torch.Tensor:
    """(B, H, Lq, Lk) bool -> (B, H, nq, nk) codes, block by block with Python slices."""
    b, h, lq, lk = allowed.shape
    nq, nk = -(-lq // bq), -(-lk // bk)
    out = torch.empty(b, h, nq, nk, dtype=torch.int8)
    for i in range(nq):
        for j in range(nk):
            tile = allowed[:, :, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].flatten(2)
            out[:, :, i, j] = torch.where(tile.all(-1), FULL, torch.where(tile.any(-1), PARTIAL, EMPTY))
    return out


def by_ranges(mask: FromFn, lq: int, lk: int, bq: int, bk: int) -> torch.Tensor | None:
    return mask._codes_by_ranges(Blocks(lq, lk, bq, bk))


def check(fn, lq, lk, bq, bk, batch=None, heads=None, *, expect_ranges=True):
    truth = codes_of_pairs(flex_module.create_mask(fn, batch or 1, heads or 1, lq, lk, device="cpu"), bq, bk)
    mask = masks.from_fn(fn, batch_size=batch, num_heads=heads)
    found = by_ranges(mask, lq, lk, bq, bk)
    if expect_ranges:
        assert found is not None, "the predicate left the expression language"
        assert torch.equal(found.expand_as(truth), truth)
    assert torch.equal(mask.block_map(lq, lk, bq, bk).expand_as(truth), truth)  # whichever path it takes


attn_gym = pytest.importorskip("attn_gym")
from _gym import catalogue  # noqa: E402  (tests/_gym.py: attention-gym's masks)

GYM = catalogue(256)
GYM_LONG = catalogue(1024)


@pytest.mark.parametrize("blocks", [(128, 64), (64, 64), (32, 16), (48, 80)])
@pytest.mark.parametrize("name", list(GYM))
def test_every_attention_gym_mask_by_ranges_equals_pair_by_pair(name, blocks):
    fn, lq, lk, *lead = GYM[name]()
    check(fn, lq, lk, *blocks, *lead)


@pytest.mark.parametrize("name", list(GYM_LONG))
def test_every_attention_gym_mask_prepared_equals_pair_by_pair(name):
    """The prepared plan (block map and the bits of its partial blocks, judged by ranges in 16 x 16
    parts: attnkit/masks/_from_fn.py) holds exactly the mask's pairs."""
    fn, lq, lk, *lead = GYM_LONG[name]()
    batch, heads = lead or (None, None)
    truth = flex_module.create_mask(fn, batch or 1, heads or 1, lq, lk, device="cpu")
    prepared = attnkit.prepare(masks.from_fn(fn, batch_size=batch, num_heads=heads), lq, lk, block_size=(128, 64))
    assert torch.equal(prepared.materialize().expand_as(truth), truth)


@pytest.mark.parametrize("route", ["every pair", "ranges first"])
@pytest.mark.parametrize("name", list(GYM_LONG))
def test_codes_read_from_the_bits_equal_pair_by_pair(name, route, monkeypatch):
    """prepare's one evaluation of a program's pairs (``FromFn.codes_with_tiles``: every pair of a small
    problem, else the pairs the ranges leave undecided) gives each block's exact code and the partial
    blocks' exact bits, as the block map followed by the bits does."""
    fn, lq, lk, *lead = GYM_LONG[name]()
    batch, heads = lead or (None, None)
    monkeypatch.setattr(_from_fn, "EVERY_PAIR_UP_TO", 1 << 40 if route == "every pair" else 0)
    monkeypatch.setattr(_from_fn, "TILES_AT_ONCE", 5)  # the tiles in several calls, their bits joined
    truth = flex_module.create_mask(fn, batch or 1, heads or 1, lq, lk, device="cpu")
    mask = masks.from_fn(fn, batch_size=batch, num_heads=heads)
    made, original = [], FromFn.codes_with_tiles

    def spy(self, *args):
        made.append(original(self, *args))
        return made[-1]

    monkeypatch.setattr(FromFn, "codes_with_tiles", spy)
    prepared = attnkit.prepare(mask, lq, lk, block_size=(128, 64))
    # every gym mask but VSA's is a program (run by the native engine); lengths that are not multiples of
    # the blocks take the two passes
    runs = _program.available() and name != "vsa" and lq % 128 == 0 and lk % 64 == 0
    assert made and (made[-1] is not None) == runs
    assert torch.equal(prepared.codes.expand(truth.shape[0], truth.shape[1], -1, -1), codes_of_pairs(truth, 128, 64))
    assert torch.equal(prepared.materialize().expand_as(truth), truth)
    monkeypatch.setattr(FromFn, "codes_with_tiles", lambda self, *args: None)
    two_passes = attnkit.prepare(mask, lq, lk, block_size=(128, 64))  # the block map, then the bits
    for name in ("codes", "kv_num", "kv_indices", "bits", "tile_ids"):
        assert torch.equal(getattr(prepared, name), getattr(two_passes, name)), name


@pytest.mark.parametrize("route", ["every pair", "ranges first"])
def test_codes_read_from_the_bits_with_an_offset_per_sequence(route, monkeypatch):
    """A predicate shifted per sequence (as in a KV cache of mixed fills) has one map per sequence on
    the one-evaluation route too, equal to the two passes' and to the mask's own pairs."""
    monkeypatch.setattr(_from_fn, "EVERY_PAIR_UP_TO", 1 << 40 if route == "every pair" else 0)
    mask = masks.from_fn(lambda b, h, q, kv: (q // 64) >= (kv // 64))._in_cache(torch.tensor([128, 256, 0]))
    prepared = attnkit.prepare(mask, 256, 512, block_size=(128, 64))
    truth = mask.materialize(256, 512)
    assert torch.equal(prepared.materialize().expand_as(truth), truth)
    monkeypatch.setattr(FromFn, "codes_with_tiles", lambda self, *args: None)
    two_passes = attnkit.prepare(mask, 256, 512, block_size=(128, 64))
    for name in ("codes", "kv_num", "kv_indices", "bits", "tile_ids"):
        assert torch.equal(getattr(prepared, name), getattr(two_passes, name)), name


def test_tiles_by_ranges_evaluate_only_the_parts_they_cannot_decide():
    """Causal tiles of 128 x 64 on the diagonal: of each tile's 32 parts of 16 x 16, the ranges
    decide all but the 4 the diagonal crosses."""
    mask = masks.from_fn(lambda b, h, q, kv: q >= kv)
    seen = []

    def spy(b, h, q, kv):
        if isinstance(q, torch.Tensor):  # not the ranges
            seen.append(tuple(torch.broadcast_shapes(q.shape, kv.shape)))
        return q >= kv

    mask.fn = spy
    tiles = torch.arange(8)
    zero = torch.zeros(8, 1, 1, dtype=torch.long)
    q_idx = (tiles * 128).view(-1, 1, 1) + torch.arange(128).view(1, 1, -1)
    kv_idx = (tiles * 128).view(-1, 1, 1) + torch.arange(64).view(1, -1, 1)  # the first half of each diagonal
    found = mask.tiles(zero, zero, q_idx, kv_idx, 1024, 1024)
    assert torch.equal(found, q_idx >= kv_idx)
    assert max(seen, key=lambda shape: torch.Size(shape).numel()) == (8 * 4, 16, 16)  # those parts alone


def test_ranges_decide_every_block_but_the_edges(monkeypatch):
    """Causal at L=1024 in (128, 64) blocks: the ranges decide every 64 x 64 part but the 16 on the
    diagonal; of those only the first row and column are evaluated (they hold an allowed and a
    hidden pair: partial), never the 64 x 64 pairs. (With torch: the native engine's program
    evaluates the 16 parts itself, tests/test_predicate_programs.py.)"""
    monkeypatch.setattr(_from_fn, "NATIVE_FROM", 1 << 62)
    mask = masks.from_fn(lambda b, h, q, kv: q >= kv)
    evaluated = []
    pairs = mask._pairs

    def counting(b, h, q_idx, kv_idx, **how):
        evaluated.append(q_idx.shape[0] * q_idx.shape[1] * kv_idx.shape[1])
        return pairs(b, h, q_idx, kv_idx, **how)

    mask._pairs = counting
    codes = by_ranges(mask, 1024, 1024, 128, 64)
    assert evaluated == [16 * 64, 16 * 64]
    assert torch.equal(codes[0, 0], masks.causal().block_map(1024, 1024, 128, 64)[0, 0])


def test_offsets_per_sequence_and_lengths_that_are_not_multiples():
    docs = torch.tensor([0] * 37 + [1] * 60 + [2] * 103)

    def fn(b, h, q, kv):
        return (docs[q] == docs[kv]) & (kv <= q) & (kv % (h + 2) != 0)

    check(fn, 200, 200, 32, 16, None, 3)
    offsets = torch.tensor([0, 40])
    mask = masks.from_fn(lambda b, h, q, kv: (q - kv).abs() < 9, batch_size=2, q_offset=offsets, kv_offset=offsets)
    rows = mask._codes_by_rows(Blocks(150, 150, 32, 32))
    assert torch.equal(by_ranges(mask, 150, 150, 32, 32), rows.expand(2, 1, -1, -1))


def test_values_of_one_pair_with_dims_of_their_own_as_under_vmap():
    """A captured tensor is one value per pair (torch.vmap's semantics): ``kv == G`` with ``G`` of shape
    (2,) is two bools per pair, reduced over them by ``any``; a row of a table, indexed again."""
    marked = torch.tensor([3, 40])
    check(lambda b, h, q, kv: torch.any(kv == marked) | (q >= kv), 64, 64, 16, 16)
    spans = torch.tensor([[0, 20], [10, 64]])
    check(lambda b, h, q, kv: (q >= spans[kv // 32][0]) & (q < spans[kv // 32][1]), 64, 64, 16, 16)


@pytest.mark.parametrize(
    "fn",
    [
        lambda b, h, q, kv: (q >= kv) & (torch.sin(q.float()) > 0),  # no rule bounds sin
        lambda b, h, q, kv: (q >= kv) | (torch.exp(kv.double() / 8) > 3),  # nor exp
    ],
)
def test_what_the_ranges_cannot_bound_takes_the_pair_by_pair_path(fn):
    mask = masks.from_fn(fn)
    assert by_ranges(mask, 64, 64, 16, 16) is None
    truth = codes_of_pairs(mask.materialize(64, 64), 16, 16)
    assert torch.equal(mask.block_map(64, 64, 16, 16), truth)


def test_a_predicate_that_indexes_out_of_range_fails_as_it_does_pair_by_pair():
    table = torch.arange(10)
    mask = masks.from_fn(lambda b, h, q, kv: table[q] >= kv)
    assert by_ranges(mask, 64, 64, 16, 16) is None
    with pytest.raises(Exception, match="index"):
        mask.block_map(64, 64, 16, 16)
