"""The host-side reading of a plan: which sequences and heads share a block map, and for each row
block of queries the runs of adjacent key blocks it visits; causal squares among them.

A shared part of the kernels (no kernel of its own): the PyTorch engines' walk
(:mod:`attnkit.kernels.runs`) computes one exact attention call per run, the statistics walk
reduces per run, and :mod:`attnkit.kernels.sparsity` asks whether a plan is causal squares and full
blocks. Everything here is derived from a :class:`~attnkit.PreparedMask`'s block codes, key limits
and bits (never from its mask object) and kept in its store (:func:`attnkit._cache.plan_store`),
so it is worked out once per prepared mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnkit import _cache
from attnkit import masks as _masks
from attnkit.plan import PreparedMask

__all__ = [
    "MAX_MASKED_TILE",
    "MAX_ROWS",
    "MIN_FULL_RUN",
    "SQUARE_MIN_ROWS",
    "Group",
    "RowBlock",
    "Run",
    "Square",
    "groups",
    "single",
    "steps_with_squares",
]

#: A stretch of FULL key blocks shorter than this is computed with its PARTIAL
#: neighbours under one mask: one masked call is cheaper than splitting and merging.
MIN_FULL_RUN = 1024
#: Adjacent row blocks with the same runs are computed as one, up to this many
#: (query, key) pairs per run when the run needs its element mask.
MAX_MASKED_TILE = 2**20
MAX_ROWS = 4096
#: Causal squares from this many rows on run as one ``is_causal`` call: PyTorch's fused kernel
#: tiles 256 queries x 512 keys from 768 queries on, and skips the tiles above the diagonal; on
#: smaller squares its 512-key tiles compute the whole square, and the per-row-block runs win
#: (benchmarks/cpu.py, documents of 512 vs 768-2048 tokens with a causal mask).
SQUARE_MIN_ROWS = 768


@dataclass(frozen=True)
class Run:
    """Keys ``[k0, k1)`` of one row block; ``full`` means every pair may attend."""

    k0: int
    k1: int
    full: bool


@dataclass(frozen=True)
class RowBlock:
    """Queries ``[q0, q1)`` and the runs of keys they attend to."""

    q0: int
    q1: int
    runs: tuple[Run, ...]


@dataclass(frozen=True)
class Group:
    """Rows of the batch and heads that share one plan.

    ``batch``/``heads`` index the mask's batch and head axes; None means all of them
    (or the mask does not differ along that axis).
    """

    batch: tuple[int, ...] | None
    heads: tuple[int, ...] | None
    rows: tuple[RowBlock, ...]

    @property
    def masked(self) -> bool:
        return any(not run.full for row in self.rows for run in row.runs)


@dataclass(frozen=True)
class Square:
    """Row blocks ``[a, b)`` that see keys ``[c, a)`` entirely and ``[a, b)`` causally (a document's
    causal square, a prefix-LM's causal rows): one ``is_causal`` call of the fused kernel over the
    square and one unmasked call over the rectangle, instead of one call per row block."""

    a: int
    b: int
    c: int


def groups(prepared: PreparedMask) -> tuple[Group, ...]:
    """The plan's groups: sequences (and heads) with equal block maps and limits share one."""
    store = _cache.plan_store(prepared)
    found = store.get("groups")
    if found is None:
        bq, bk = prepared.block_size
        found = _plan_groups(prepared.codes.cpu().numpy(), prepared.kv_limits, prepared.q_len, prepared.kv_len, bq, bk)
        store.put("groups", found, 64 * sum(len(g.rows) for g in found))
    return found


def single(prepared: PreparedMask) -> bool:
    """Whether one group covers every sequence and head."""
    found = groups(prepared)
    return len(found) == 1 and found[0].batch is None and found[0].heads is None


def _plan_groups(codes: np.ndarray, limits, q_len, kv_len, bq, bk) -> tuple[Group, ...]:
    """Group rows (and heads) with equal block maps and limits; one plan per group."""
    bm, hm = codes.shape[:2]
    by_batch: dict = {}
    for b in range(bm):
        limit = None if limits is None else limits[min(b, len(limits) - 1)]
        by_batch.setdefault((codes[b].tobytes(), limit), []).append(b)
    found = []
    for (_, lim), rows in by_batch.items():
        batch = None if len(by_batch) == 1 else tuple(rows)
        by_head: dict = {}
        for h in range(hm):
            by_head.setdefault(codes[rows[0], h].tobytes(), []).append(h)
        for heads in by_head.values():
            state = codes[rows[0], heads[0]]
            end = kv_len if lim is None else lim
            found.append(
                Group(batch, None if len(by_head) == 1 else tuple(heads), _plan_rows(state, end, q_len, bq, bk))
            )
    return tuple(found)


def _plan_rows(state: np.ndarray, kv_end: int, q_len: int, bq: int, bk: int) -> tuple[RowBlock, ...]:
    rows: list[RowBlock] = []
    for i in range(state.shape[0]):
        block = RowBlock(i * bq, min((i + 1) * bq, q_len), _runs(state[i], bk, kv_end))
        if rows and rows[-1].runs == block.runs and _can_grow(rows[-1], block):
            block = RowBlock(rows[-1].q0, block.q1, block.runs)  # one call for both
            rows.pop()
        rows.append(block)
    return tuple(rows)


def _can_grow(prev: RowBlock, block: RowBlock) -> bool:
    rows = block.q1 - prev.q0
    if rows > MAX_ROWS:
        return False
    return all(run.full or rows * (run.k1 - run.k0) <= MAX_MASKED_TILE for run in block.runs)


def _runs(row: np.ndarray, bk: int, kv_end: int) -> tuple[Run, ...]:
    """The runs of one row of block codes, keys clipped at ``kv_end``.

    Non-empty blocks that touch form one run; a FULL stretch of at least
    MIN_FULL_RUN keys becomes a run of its own that skips the element mask.
    """
    idx = np.flatnonzero(row)
    if idx.size == 0:
        return ()
    codes = row[idx]
    breaks = np.flatnonzero((np.diff(idx) != 1) | (np.diff(codes) != 0)) + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), idx.size]
    segments = [
        (int(idx[s]) * bk, min(int(idx[e - 1] + 1) * bk, kv_end), bool(codes[s] == _masks.FULL))
        for s, e in zip(starts, ends)
    ]
    segments = [seg for seg in segments if seg[1] > seg[0]]

    def touches_partial(i: int) -> bool:
        before = i > 0 and segments[i - 1][1] == segments[i][0] and not segments[i - 1][2]
        after = i + 1 < len(segments) and segments[i + 1][0] == segments[i][1] and not segments[i + 1][2]
        return before or after

    # a full stretch too short to be worth a call of its own joins its partial neighbours
    runs: list[list] = []
    for i, (k0, k1, full) in enumerate(segments):
        full = full and (k1 - k0 >= MIN_FULL_RUN or not touches_partial(i))
        if runs and runs[-1][1] == k0 and runs[-1][2] == full:
            runs[-1][1] = k1
        else:
            runs.append([k0, k1, full])
    return tuple(Run(k0, k1, full) for k0, k1, full in runs)


# --- causal squares ------------------------------------------------------------------------------


def _group_tile(prepared: PreparedMask, group: Group, row: RowBlock, run: Run) -> torch.Tensor:
    """The allowed pairs of one run for the group's sequences and heads: ``(Bg or 1, Hg or 1, n, S)``."""
    tile = prepared.allowed(row.q0, row.q1, run.k0, run.k1)
    if group.batch is not None and tile.shape[0] > 1:
        tile = tile[list(group.batch)]
    if group.heads is not None and tile.shape[1] > 1:
        tile = tile[:, list(group.heads)]
    return tile


def _diagonal(prepared: PreparedMask, group: Group, row: RowBlock) -> int | None:
    """c when the row block sees keys [c, q0) fully and [q0, q1) causally (for every sequence and
    head of the group), else None."""
    runs = row.runs
    if not runs or runs[-1].full or runs[-1].k1 != row.q1 or runs[-1].k0 > row.q0:
        return None
    if len(runs) == 2 and runs[0].full and runs[0].k1 == runs[-1].k0:
        c = runs[0].k0
    elif len(runs) == 1:
        c = runs[0].k0
    else:
        return None
    allowed = _group_tile(prepared, group, row, runs[-1])
    left, n = row.q0 - runs[-1].k0, row.q1 - row.q0
    tril = torch.ones(n, n, dtype=torch.bool, device=allowed.device).tril_()
    if not (bool(allowed[..., :left].all()) and bool((allowed[..., left:] == tril).all())):
        return None
    return c


def steps_with_squares(prepared: PreparedMask, gi: int) -> tuple[RowBlock | Square, ...]:
    """Group ``gi``'s row blocks, with the stretches that form a causal square of at least
    :data:`SQUARE_MIN_ROWS` rows merged into a :class:`Square` (kept in the prepared mask's store)."""
    group = groups(prepared)[gi]
    if len(group.rows) < 2:
        return group.rows
    store = _cache.plan_store(prepared)
    key = ("squares", gi)
    found = store.get(key)
    if found is not None:
        return found
    steps: list[RowBlock | Square] = []
    pending: list[RowBlock] = []  # row blocks of the square being built
    start = 0

    def close() -> None:
        if pending and pending[-1].q1 - pending[0].q0 >= SQUARE_MIN_ROWS:
            steps.append(Square(pending[0].q0, pending[-1].q1, start))
        else:
            steps.extend(pending)
        pending.clear()

    for row in group.rows:
        c = _diagonal(prepared, group, row)
        if c is not None and pending and row.q0 == pending[-1].q1 and c == start:
            pending.append(row)
            continue
        close()
        if c is not None and c <= row.q0:
            pending.append(row)
            start = c
        else:
            steps.append(row)
    close()
    found = tuple(steps)
    store.put(key, found, 64 * len(found))
    return found
