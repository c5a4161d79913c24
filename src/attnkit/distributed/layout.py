"""How a sequence is split over the ranks of a process group, and what each rank needs.

A sequence of length ``L`` is cut into ``W`` (``layout="contiguous"``) or ``2W``
(``layout="zigzag"``) chunks whose sizes differ by at most one, like
``torch.tensor_split``. Under ``contiguous`` rank r holds chunk r; under ``zigzag``
it holds chunks r and 2W-1-r, so that with a causal mask every rank has the same
amount of work. A rank's part of the sequence is a list of *pieces*: global
``(start, stop)`` ranges, concatenated in that order along the sequence dimension.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from attnkit import masks as _masks
from attnkit._validate import AttnkitTypeError, AttnkitValueError, short

#: One contiguous piece of a split sequence: its ``(start, end)`` global indices.
Span = tuple[int, int]

LAYOUTS = ("contiguous", "zigzag")

#: Block size used to decide whether a (query piece, key piece) pair has any allowed pair.
PLAN_BLOCK = 256


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise AttnkitValueError(f"layout must be 'contiguous' or 'zigzag', but got {short(layout)}.")
    return layout


def _bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive ranges covering ``range(length)``, sizes differing by at most 1."""
    base, extra = divmod(length, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def pieces(length: int, world_size: int, layout: str) -> list[list[tuple[int, int]]]:
    """For every rank, the global ranges it holds, in the order they are concatenated.

    >>> pieces(10, 2, "zigzag")
    [[(0, 3), (8, 10)], [(3, 6), (6, 8)]]
    >>> pieces(10, 2, "contiguous")
    [[(0, 5)], [(5, 10)]]
    """
    check_layout(layout)
    if layout == "contiguous":
        return [[r] for r in _bounds(length, world_size)]
    chunks = _bounds(length, 2 * world_size)
    return [[chunks[r], chunks[2 * world_size - 1 - r]] for r in range(world_size)]


def positions(length: int, world_size: int, rank: int, layout: str) -> torch.Tensor:
    """The global positions of rank ``rank``'s part, ``(L_local,)`` int64 (for RoPE)."""
    return torch.cat([torch.arange(a, b) for a, b in pieces(length, world_size, layout)[rank]])


def as_ring_mask(mask: object) -> _masks.Mask | None:
    """The mask as a mask object (bool tensors wrapped); refuse what cannot be split."""
    from attnkit.plan import PreparedMask

    if mask is None or isinstance(mask, _masks.Mask):
        return mask
    if isinstance(mask, PreparedMask):
        raise AttnkitTypeError(
            "ring attention takes the mask object (e.g. masks.causal()), not a PreparedMask: each rank "
            "prepares the parts it computes."
        )
    if isinstance(mask, torch.Tensor):
        if mask.dtype != torch.bool:
            raise AttnkitTypeError(
                f"ring attention takes bool masks (True = may attend), but got a {mask.dtype} tensor; pass "
                "an additive float mask as attn_bias=attnkit.bias.dense(tensor)."
            )
        return _masks.dense(mask)
    raise AttnkitTypeError(
        f"mask must be None, an attnkit.masks object or a bool tensor, but got {type(mask).__name__}."
    )


def part_of(mask: _masks.Mask | None, q_len: int, kv_len: int, q_piece: Span, kv_piece: Span) -> _masks.Mask | None:
    """The mask restricted to one (query piece, key piece) rectangle (None stays None)."""
    if mask is None:
        return None
    (a, b), (c, d) = q_piece, kv_piece
    return mask.part(q_len, kv_len, q=slice(a, b), kv=slice(c, d))


def kept_span(
    mask: _masks.Mask | None, q_len: int, kv_len: int, q_piece: Span, kv_piece: Span
) -> tuple[int, int] | None:
    """The global key range ``(lo, hi)`` within ``kv_piece`` that queries of ``q_piece`` may
    attend (to ``PLAN_BLOCK`` keys, never missing one), or None if there is none."""
    (a, b), (c, d) = q_piece, kv_piece
    if b == a or d == c:
        return None
    if mask is None:
        return (c, d)
    part = part_of(mask, q_len, kv_len, q_piece, kv_piece)
    assert part is not None  # a part of a mask is a mask
    codes = part.block_map(b - a, d - c, PLAN_BLOCK, PLAN_BLOCK, device="cpu")
    kept = (codes != _masks.EMPTY).reshape(-1, codes.shape[-1]).any(0).nonzero()
    if kept.numel() == 0:
        return None
    return c + int(kept[0]) * PLAN_BLOCK, min(d, c + (int(kept[-1]) + 1) * PLAN_BLOCK)


def kept_area(
    mask: _masks.Mask | None, q_len: int, kv_len: int, q_piece: Span, kv_piece: Span, block: int = 128
) -> int:
    """Query-key pairs in the kept ``block x block`` tiles of a rectangle (the kernel's work)."""
    (a, b), (c, d) = q_piece, kv_piece
    if b == a or d == c:
        return 0
    if mask is None:
        return (b - a) * (d - c)
    part = part_of(mask, q_len, kv_len, q_piece, kv_piece)
    assert part is not None  # a part of a mask is a mask
    codes = part.block_map(b - a, d - c, block, block, device="cpu")
    kept = (codes != _masks.EMPTY).any(0).any(0)  # (nq, nk): kept for some sequence or head
    rows = torch.tensor([min(block, b - a - i) for i in range(0, b - a, block)])
    cols = torch.tensor([min(block, d - c - j) for j in range(0, d - c, block)])
    return int((kept * rows[:, None] * cols[None, :]).sum())


@dataclass(frozen=True)
class Schedule:
    """Who computes what with whose keys, for one ring call; the same on every rank.

    ``q_pieces[r]`` / ``kv_pieces[r]`` are rank r's global ranges. ``pairs[r][c]``
    lists the ``(query piece index, key piece index)`` rectangles rank r computes with
    rank c's keys (those the mask does not empty); ``needs[r][c]`` the ``(key piece
    index, lo, hi)`` global key ranges of rank c's pieces that rank r reads (and
    receives): the keys its queries may attend, to ``PLAN_BLOCK`` keys. At step s rank r
    receives from rank ``(r - s) % W`` and sends to rank ``(r + s) % W``.
    """

    world_size: int
    q_len: int
    kv_len: int
    q_pieces: tuple
    kv_pieces: tuple
    pairs: tuple
    needs: tuple

    def source(self, rank: int, step: int) -> int:
        return (rank - step) % self.world_size

    def target(self, rank: int, step: int) -> int:
        return (rank + step) % self.world_size

    def span(self, rank: int, src: int, j: int) -> tuple[int, int]:
        """The key range of rank ``src``'s piece ``j`` that rank ``rank`` reads."""
        for jj, lo, hi in self.needs[rank][src]:
            if jj == j:
                return lo, hi
        raise KeyError(j)

    def keys_received(self, rank: int) -> int:
        return sum(hi - lo for c in range(self.world_size) if c != rank for _, lo, hi in self.needs[rank][c])

    def keys_sent(self, rank: int) -> int:
        return sum(hi - lo for t in range(self.world_size) if t != rank for _, lo, hi in self.needs[t][rank])


def schedule(
    mask: _masks.Mask | None, q_len: int, kv_len: int, world_size: int, layout: str, ranks: Iterable[int] | None = None
) -> Schedule:
    """The ring's plan. ``ranks``: plan only the rectangles these ranks compute or whose
    keys they hold (what one rank needs to know); default all."""
    q_pieces = pieces(q_len, world_size, layout)
    kv_pieces = pieces(kv_len, world_size, layout)
    pairs, needs = [], []
    for r in range(world_size):
        pair_row, need_row = [], []
        for c in range(world_size):
            found: list = []
            spans: dict = {}
            if ranks is None or r in ranks or c in ranks:
                for i, qp in enumerate(q_pieces[r]):
                    for j, kp in enumerate(kv_pieces[c]):
                        span = kept_span(mask, q_len, kv_len, qp, kp)
                        if span is not None:
                            found.append((i, j))
                            lo, hi = spans.get(j, span)
                            spans[j] = (min(lo, span[0]), max(hi, span[1]))
            pair_row.append(tuple(found))
            need_row.append(tuple((j, lo, hi) for j, (lo, hi) in sorted(spans.items())))
        pairs.append(tuple(pair_row))
        needs.append(tuple(need_row))
    return Schedule(
        world_size, q_len, kv_len, tuple(map(tuple, q_pieces)), tuple(map(tuple, kv_pieces)), tuple(pairs), tuple(needs)
    )
