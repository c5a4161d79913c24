"""The element bits of a plan's partial blocks: what :func:`attnkit.prepare` evaluates of a mask.

A block map says which ``bq x bk`` blocks are partial; each partial block's pairs are kept packed
key-major (eight queries a byte: :class:`attnkit.PreparedMask`'s ``bits``). Four forms, the
first the mask has:

- **query ranges** (:meth:`attnkit.masks.Mask.query_ranges`: causal, windows, prefix, padding,
  sorted document ids and their ``&``): each key's allowed queries are one range, and its bytes
  come from a table of packed prefixes, ``first[hi + 1] ^ first[lo]``; no pair is evaluated,
  O(partial tiles x bk x bq / 8);
- **packed tiles** (:meth:`attnkit.masks.Mask.packed_tiles`: ``from_fn`` predicates the native engine
  evaluates as a program, :mod:`attnkit.masks._program`): the bytes written by the engine itself;
- **tiles** (:meth:`attnkit.masks.Mask.tiles`: the structured kinds with ``|``, dense masks and
  broadcasting ``from_fn`` predicates): every partial tile evaluated at once, each at its own
  sequence and head, in chunks of :data:`TILES_AT_ONCE`, packed with ``numpy.packbits``;
- **rows**: any other mask one row of blocks at a time over that row's partial key blocks.

The cost is O(partial tiles x bq x bk) at most, never O(Lq x Lk).
"""

from __future__ import annotations

import numpy as np
import torch

from attnkit import masks as _masks
from attnkit._indexing import as4d

__all__ = ["TILES_AT_ONCE", "listed_tiles", "pack_queries", "partial_bits", "tile_coordinates"]

#: Partial tiles evaluated together by a mask's tile form (O(TILES_AT_ONCE x bq x bk) memory).
TILES_AT_ONCE = 1024


def partial_bits(mask, q_len, kv_len, block_size, codes, kv_indices) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bits (T, bk, ceil(bq / 8)) uint8, tile_ids)`` of the partial blocks of ``codes`` (one host
    sync: which blocks are partial); at least one tile (all zeros where there is none)."""
    bq, bk = block_size
    nq, nk = codes.shape[-2:]
    where = (codes == _masks.PARTIAL).nonzero().cpu()  # (T, 4): b, h, i, j
    if where.shape[0] == 0:
        return listed_tiles(codes, kv_indices, where, torch.zeros(0, bk, -(-bq // 8), dtype=torch.uint8))
    assert mask is not None, "partial blocks come from a mask"
    packed = _by_ranges(mask, q_len, kv_len, block_size, where)
    if packed is None:
        packed = mask.packed_tiles(where, q_len, kv_len, block_size)
    if packed is None:
        keys_major = _by_tiles(mask, q_len, kv_len, block_size, where)
        if keys_major is None:
            where, tiles = _by_rows(mask, q_len, kv_len, block_size, where, nq, nk)
            keys_major = tiles.transpose(1, 2).contiguous()
        # key-major, eight queries a byte (bit r % 8 of byte r // 8 is query r; queries padded with zeros)
        packed = torch.from_numpy(np.packbits(keys_major.numpy(), axis=-1, bitorder="little"))
    return listed_tiles(codes, kv_indices, where, packed)


def listed_tiles(codes, kv_indices, where, packed) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bits, tile_ids)`` of :func:`partial_bits` from the partial blocks ``where (T, 4)`` (b, h, i, j)
    and their packed bits ``(T, bk, ceil(bq / 8))`` (at least one tile: zeros where there is none)."""
    if where.shape[0] == 0:
        packed = torch.zeros(1, *packed.shape[1:], dtype=torch.uint8)
    ids = torch.full(codes.shape, -1, dtype=torch.int32)
    ids[where[:, 0], where[:, 1], where[:, 2], where[:, 3]] = torch.arange(where.shape[0], dtype=torch.int32)
    listed = ids.gather(-1, kv_indices.long().cpu().clamp(min=0))
    return packed.to(codes.device).contiguous(), listed.to(codes.device).contiguous()


def _by_ranges(mask, q_len, kv_len, block_size, where) -> torch.Tensor | None:
    """Every partial tile packed ``(T, bk, ceil(bq / 8))`` uint8 straight from the mask's query
    ranges (:meth:`~attnkit.masks.Mask.query_ranges`), without evaluating a pair: a key whose
    queries are ``[lo, hi]`` of its tile packs as ``first[hi + 1] ^ first[lo]``, ``first[n]`` the
    packed row of the tile's first ``n`` queries. None where the mask has no range form."""
    bq, bk = block_size
    first = _first_queries(bq)
    keys = torch.arange(bk, dtype=torch.int32)
    out = []
    for start in range(0, where.shape[0], 8 * TILES_AT_ONCE):
        part = where[start : start + 8 * TILES_AT_ONCE].to(torch.int32)
        b, h = part[:, 0:1], part[:, 1:2]
        kv_idx = part[:, 3:4] * bk + keys  # (n, bk)
        found = mask.query_ranges(b, h, kv_idx.clamp(max=max(kv_len - 1, 0)), q_len, kv_len)
        if found is None:
            return None
        q0 = part[:, 2:3] * bq  # each tile's first query
        end = (torch.clamp(found[1], max=q_len - 1) - q0 + 1).clamp(0, bq)  # tile-local, exclusive
        end = torch.where(kv_idx < kv_len, end, 0) if kv_len % bk else end  # keys past Lk: no query
        lo = torch.minimum((found[0] - q0).clamp(0, bq), end)
        end, lo = end.expand(part.shape[0], bk).reshape(-1), lo.expand(part.shape[0], bk).reshape(-1)
        packed = first.index_select(0, end.long()) ^ first.index_select(0, lo.long())
        out.append(packed.view(part.shape[0], bk, -1))
    return out[0] if len(out) == 1 else torch.cat(out)


_FIRST: dict[int, torch.Tensor] = {}


def _first_queries(bq: int) -> torch.Tensor:
    """``(bq + 1, ceil(bq / 8))`` uint8: row ``n`` packs a tile column whose first ``n`` queries are set."""
    if bq not in _FIRST:
        rows = torch.arange(bq)[None, :] < torch.arange(bq + 1)[:, None]
        _FIRST[bq] = torch.from_numpy(np.packbits(rows.numpy(), axis=-1, bitorder="little"))
    return _FIRST[bq]


def _by_tiles(mask, q_len, kv_len, block_size, where) -> torch.Tensor | None:
    """Every partial tile from the mask's tile form, key-major ``(T, bk, bq)`` bool (queries along
    the last axis, as they are packed), or None where the mask has no tile form."""
    bq, bk = block_size
    rows, keys = torch.arange(bq, dtype=torch.int32), torch.arange(bk, dtype=torch.int32)
    ragged = q_len % bq != 0 or kv_len % bk != 0  # the last blocks hold rows or keys past the lengths
    out = []
    for start in range(0, where.shape[0], TILES_AT_ONCE):
        part = where[start : start + TILES_AT_ONCE].to(torch.int32)
        b, h = part[:, 0].view(-1, 1, 1), part[:, 1].view(-1, 1, 1)
        q_idx = part[:, 2].view(-1, 1, 1) * bq + rows.view(1, 1, -1)  # (n, 1, bq): queries along the last axis
        kv_idx = part[:, 3].view(-1, 1, 1) * bk + keys.view(1, -1, 1)  # (n, bk, 1)
        inside = (q_idx < q_len) & (kv_idx < kv_len) if ragged else None
        if ragged:
            q_idx, kv_idx = q_idx.clamp(max=max(q_len - 1, 0)), kv_idx.clamp(max=max(kv_len - 1, 0))
        e = mask.tiles(b, h, q_idx, kv_idx, q_len, kv_len)
        if e is None:
            return None
        e = e.cpu().expand(part.shape[0], bk, bq)
        out.append(e & inside if inside is not None else e)
    return out[0].contiguous() if len(out) == 1 else torch.cat(out)


def _by_rows(mask, q_len, kv_len, block_size, where, nq, nk) -> tuple[torch.Tensor, torch.Tensor]:
    """``(where, tiles)``: the mask evaluated one row of blocks at a time, over the key blocks
    partial there in some sequence or head; tiles in the order of the returned ``where``."""
    bq, bk = block_size
    where = where[torch.argsort(where[:, 2], stable=True)]  # by row of blocks
    starts = torch.searchsorted(where[:, 2].contiguous(), torch.arange(nq + 1)).tolist()
    last_q, last_k = max(q_len - 1, 0), max(kv_len - 1, 0)
    tiles = []
    for i in range(nq):
        part = where[starts[i] : starts[i + 1]]
        if part.shape[0] == 0:
            continue
        cols = torch.unique(part[:, 3])
        position = torch.full((nk,), -1, dtype=torch.long)
        position[cols] = torch.arange(len(cols))
        q_idx = torch.arange(i * bq, (i + 1) * bq)[:, None]
        kv_idx = (cols[:, None] * bk + torch.arange(bk)[None, :]).reshape(1, -1)
        inside = (q_idx < q_len) & (kv_idx < kv_len)
        e = as4d(mask.elements(q_idx.clamp(max=last_q), kv_idx.clamp(max=last_k), q_len, kv_len)).cpu() & inside
        e = e.reshape(e.shape[0], e.shape[1], bq, len(cols), bk)
        b_sel, h_sel = part[:, 0].clamp(max=e.shape[0] - 1), part[:, 1].clamp(max=e.shape[1] - 1)
        tiles.append(e[b_sel, h_sel, :, position[part[:, 3]], :])  # (n, bq, bk)
    return where, torch.cat(tiles)


def pack_queries(keys_major: torch.Tensor) -> torch.Tensor:
    """``(T, bk, bq)`` bool (queries along the last axis) packed eight queries a byte, ``(T, bk,
    ceil(bq / 8))`` uint8 (bit ``r % 8`` of byte ``r // 8`` is query ``r``): what ``numpy.packbits(...,
    bitorder="little")`` gives, in torch operations (it traces under torch.compile)."""
    t, bk, bq = keys_major.shape
    padded = torch.nn.functional.pad(keys_major.to(torch.uint8), (0, -bq % 8))  # (T, bk, 8 * nb)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=keys_major.device)
    return (padded.view(t, bk, -1, 8) * weights).sum(-1, dtype=torch.uint8)


def tile_coordinates(tile_ids: torch.Tensor, kv_indices: torch.Tensor, tiles: int) -> torch.Tensor:
    """``(tiles, 4)`` int64: the ``(b, h, i, j)`` block of each partial tile of a plan, from its
    ``tile_ids`` and ``kv_indices`` ``(Bm, Hm, nq, nk)`` (listed order), in torch operations with
    static shapes (it traces under torch.compile): each listed slot writes its block to its tile's
    row, slots of full blocks to rows past the end that are dropped."""
    bm, hm, nq, nk = tile_ids.shape
    dev = tile_ids.device
    coords = torch.stack(
        [
            torch.arange(bm, device=dev).view(-1, 1, 1, 1).expand(bm, hm, nq, nk),
            torch.arange(hm, device=dev).view(1, -1, 1, 1).expand(bm, hm, nq, nk),
            torch.arange(nq, device=dev).view(1, 1, -1, 1).expand(bm, hm, nq, nk),
            kv_indices.long(),
        ],
        dim=-1,
    ).reshape(-1, 4)
    ids = tile_ids.reshape(-1).long()
    spare = tiles + torch.arange(ids.shape[0], device=dev)  # one row each past the end: no index twice
    out = torch.zeros(tiles + ids.shape[0], 4, dtype=torch.int64, device=dev)
    return out.index_copy(0, torch.where(ids >= 0, ids, spare), coords)[:tiles]
