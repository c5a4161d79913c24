"""One run of a plan as tensors: what the PyTorch engines' walk, its statistics and its backward
share.

A plan (:mod:`attnkit.kernels.blocks`) lists, per group of batch rows and heads, row blocks of
queries and the runs of key blocks they attend. This module turns one run into tensors: the
folded queries (grouped query heads folded into rows, so K/V are never copied per query head),
the K/V slice (keys no row uses zeroed, so NaN there cannot leak), the mask tile (read from the
PreparedMask's bits, kept in its store) and the bias tile, and the scores of the math engine.
Shapes: a group's inputs are ``q: (B, Hq, Lq, D)``, ``k: (B, Hkv, Lk, D)``, ``v: (B, Hkv, Lk, Dv)``;
a folded run is ``(B, Hkv, g*n, S)`` with ``g = Hq / Hkv`` and ``n`` rows, ``S`` keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, Union

import torch

from attnkit import _cache
from attnkit._indexing import as4d
from attnkit.kernels.blocks import Group, RowBlock, Run
from attnkit.kernels.dense import used_keys
from attnkit.plan import PreparedMask

if TYPE_CHECKING:
    from attnkit.bias import Bias
    from attnkit.call import Call
    from attnkit.score_mods import ScoreMod

#: Which rows or heads :func:`take` keeps: all (None), a contiguous ``(start, length)``, or an index tensor.
TakeIndex = Union[tuple[int, int], torch.Tensor, None]

__all__ = [
    "EXP_FLOOR",
    "Grads",
    "Pair",
    "Tensor",
    "MATH_ROWS",
    "NEG_INF",
    "Select",
    "Tile",
    "TileCall",
    "bias_tile",
    "compute_dtype",
    "fold",
    "fold_tile",
    "group_inputs",
    "index_of",
    "mask_tile",
    "math_rows",
    "put",
    "put_rows",
    "run_inputs",
    "scores",
    "select",
    "take",
    "unfold",
    "weights",
]

NEG_INF = float("-inf")

#: The walk's tensors and results: one tensor, ``(out, lse)``, ``(dq, dk, dv)``.
Tensor: TypeAlias = torch.Tensor
Pair: TypeAlias = tuple[torch.Tensor, torch.Tensor]
Grads: TypeAlias = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


# --- folding grouped query heads into rows ----------------------------------------------


def fold(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """``(B, Hq, n, X) -> (B, Hkv, group * n, X)``; query head h belongs to K/V head h // group."""
    b, hq, n, x = t.shape
    return t.reshape(b, hkv, (hq // hkv) * n, x)


def unfold(t: torch.Tensor, hq: int) -> torch.Tensor:
    """Inverse of :func:`fold` for ``(B, Hkv, group * n, ...)`` tensors."""
    b, hkv, rows = t.shape[:3]
    return t.reshape(b, hq, rows * hkv // hq, *t.shape[3:])


def fold_tile(tile: torch.Tensor, hq: int, hkv: int) -> torch.Tensor:
    """A mask tile ``(Bm, 1 or Hq, n, S)`` laid out like folded queries."""
    group = hq // hkv
    if group == 1:
        return tile
    if tile.shape[1] == 1:
        return tile.repeat(1, 1, group, 1)  # (Bm, 1, group * n, S)
    return fold(tile, hkv)


# --- selecting the rows and heads of a group ---------------------------------------------


def index_of(idx: Sequence[int], device: torch.device) -> TakeIndex:
    """``(start, length)`` for a contiguous run of indices, else an index tensor."""
    if idx[-1] - idx[0] + 1 == len(idx):
        return (idx[0], len(idx))
    return torch.tensor(idx, device=device)


def take(t: torch.Tensor, dim: int, idx: TakeIndex) -> torch.Tensor:
    """``t`` at ``idx`` along ``dim``: everything (None), a narrow ``(start, length)`` or an index tensor."""
    if idx is None:
        return t
    if isinstance(idx, tuple):
        return t.narrow(dim, idx[0], idx[1])
    return t.index_select(dim, idx)


def put(dst: torch.Tensor, dim: int, idx: TakeIndex, src: torch.Tensor, add: bool = False) -> None:
    """Write (or add) ``src`` into ``dst`` at ``idx`` along ``dim`` (the inverse of :func:`take`)."""
    if idx is None:
        dst.add_(src) if add else dst.copy_(src)
    elif isinstance(idx, tuple):
        part = dst.narrow(dim, idx[0], idx[1])
        part.add_(src) if add else part.copy_(src)
    else:
        dst.index_add_(dim, idx, src) if add else dst.index_copy_(dim, idx, src)


@dataclass
class Select:
    """Which rows of the inputs (and of mask tiles) and which heads a group covers."""

    batch: TakeIndex  # None, (start, length) or an index tensor, on the inputs' batch axis
    tile_batch: TakeIndex  # the same on the mask's batch axis (None when the mask has 1 row)
    q_heads: TakeIndex  # None or (start, length) / index tensor of query heads
    kv_heads: TakeIndex  # the K/V heads they read
    tile_heads: TakeIndex
    b_idx: torch.Tensor | None = None  # (Bs, 1, 1, 1) batch rows and (1, Hs, 1, 1) query heads,
    h_idx: torch.Tensor | None = None  # the bias's index tensors (only when there is a bias)


def select(
    group: Group, prepared: PreparedMask, b: int, hq: int, hkv: int, device: torch.device, indexed: bool = False
) -> Select:
    """The rows and heads of a group; ``indexed``: also the index tensors a bias or score_mod is evaluated on."""
    batch = None if group.batch is None else index_of(group.batch, device)
    tile_batch = batch if prepared.codes.shape[0] > 1 else None
    b_idx = h_idx = None
    if indexed:
        rows = range(b) if group.batch is None else group.batch
        heads = range(hq) if group.heads is None else group.heads
        b_idx = torch.tensor(list(rows), device=device).view(-1, 1, 1, 1)
        h_idx = torch.tensor(list(heads), device=device).view(1, -1, 1, 1)
    if group.heads is None:
        return Select(batch, tile_batch, None, None, None, b_idx, h_idx)
    q_heads = index_of(group.heads, device)
    kv = [h // (hq // hkv) for h in group.heads]
    kv_heads = q_heads if hq == hkv else torch.tensor(kv, device=device)
    return Select(batch, tile_batch, q_heads, kv_heads, q_heads, b_idx, h_idx)


# --- one call --------------------------------------------------------------------------


@dataclass
class TileCall:
    """Everything a forward or backward pass needs besides the tensors."""

    prepared: PreparedMask
    scale: float
    dropout_p: float
    seed: int
    engine: str  # "fused" or "math": the engine of the walk (runs/fused_engine.py, runs/math_engine.py)
    bias: Bias | None = None  # evaluated per tile
    softcap: float | None = None
    params: tuple = ()  # the bias's and score_mod's tensors, inputs of the autograd function
    own_lse: bool = True  # the lse is this call's own (False: the merged lse of several key sets)
    score_mod: ScoreMod | None = None  # evaluated per tile
    band: torch.Tensor | None = None  # (Hq or 1, Lq + Lk - 1): a bias of kv_idx - q_idx alone (Call.bias_band)

    @classmethod
    def reduction(cls, call: Call, prepared: PreparedMask) -> TileCall:
        """The math engine's walk of ``call``'s kept tiles for a reduction of their weights (statistics,
        relevance): no dropout, the call's bias, soft-capping and score_mod evaluated per tile."""
        params = tuple(call.bias.params()) if call.bias is not None else ()
        return cls(prepared, call.scale, 0.0, 0, "math", call.bias, call.softcap, params, score_mod=call.score_mod)

    @property
    def fused(self) -> bool:
        """Whether PyTorch's fused CPU kernel computes the runs (the fused kernel)."""
        return self.engine == "fused"

    @property
    def indexed(self) -> bool:
        """Whether tiles need the index tensors of their batch rows and heads (a bias or score_mod)."""
        return self.bias is not None or self.score_mod is not None

    @property
    def may_empty_rows(self) -> bool:
        """Whether a row the mask keeps can still have no finite score (a -inf bias or score_mod)."""
        return self.bias is not None or self.score_mod is not None

    @property
    def bias_grad(self) -> bool:
        """Whether the bias's own tensors want gradients."""
        return self.bias is not None and any(t.requires_grad for t in self.bias.params())


@dataclass(frozen=True)
class Tile:
    """A partial run's mask, laid out like the folded queries ``(Bm, Hkv or 1, g*n, S)``."""

    allowed: torch.Tensor  # bool, True = may attend
    hidden_rows: torch.Tensor | None  # (Bm, Hkv or 1, g*n): rows with no key here; None if none
    used_keys: torch.Tensor | None  # (Bm, Hkv or 1, S, 1): keys some row uses; None if all
    dtype: torch.dtype  # the inputs' dtype
    cached_additive: torch.Tensor | None = None  # kept when the prepared mask's cache has room

    @property
    def additive(self) -> torch.Tensor:
        """0 / -inf in the inputs' dtype, for the fused engine (made from ``allowed`` when not kept)."""
        if self.cached_additive is not None:
            return self.cached_additive
        return _additive(self.allowed, self.dtype)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full((), NEG_INF, dtype=dtype, device=allowed.device))


def mask_tile(
    call: TileCall,
    gi: int,
    sel: Select,
    row: RowBlock,
    run: Run,
    hq: int,
    hkv: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Tile | None:
    """The evaluated mask of a partial run (None for a full one), kept in the prepared mask's store
    (:func:`attnkit._cache.plan_store`).

    The store keeps the bool tile and, while it fills less than half its bound, its additive
    form too; past that it keeps the bool tile alone (1 byte a pair, the additive form made
    per call), so the mask's elements are evaluated again only past the whole bound. Heads of
    a group whose tiles are equal are kept once.
    """
    if run.full:
        return None
    store = _cache.plan_store(call.prepared)
    key = ("mask tile", gi, row.q0, row.q1, run.k0, run.k1, hq, hkv, dtype, str(device))
    cached = store.get(key)
    if cached is not None:
        return cached
    tile = call.prepared.allowed(row.q0, row.q1, run.k0, run.k1).to(device)
    tile = take(take(tile, 0, sel.tile_batch), 1, sel.tile_heads if tile.shape[1] > 1 else None)
    tile = tile.expand(*tile.shape[:2], row.q1 - row.q0, run.k1 - run.k0)  # (Bm, Hm, n, S)
    if tile.shape[1] > 1 and bool((tile == tile[:, :1]).all()):  # the group's heads agree here
        tile = tile[:, :1]
    used = used_keys(tile, hkv)
    allowed = fold_tile(tile, hq, hkv)  # (Bm, Hkv or 1, g*n, S)
    visible = allowed.any(dim=-1)
    hidden_rows = None if visible.all() else ~visible
    used_or_all = None if used.all() else used
    additive = _additive(allowed, dtype)
    result = Tile(allowed, hidden_rows, used_or_all, dtype, additive)
    pairs = allowed.numel()
    if not store.put(key, result, pairs * (1 + additive.element_size()), within=0.5):
        store.put(key, Tile(allowed, hidden_rows, used_or_all, dtype), pairs)
    return result


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def run_inputs(
    call: TileCall, gi: int, sel: Select, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: RowBlock, run: Run
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Tile | None]:
    """Folded queries, K/V slices (keys no row uses zeroed) and the tile of one run."""
    hq, hkv = q.shape[1], k.shape[1]
    kr, vr = k[:, :, run.k0 : run.k1], v[:, :, run.k0 : run.k1]  # (B, Hkv, S, D)
    tile = mask_tile(call, gi, sel, row, run, hq, hkv, q.dtype, q.device)
    if tile is not None and tile.used_keys is not None:  # NaN/Inf in keys no query uses
        zero = k.new_zeros(())
        kr, vr = torch.where(tile.used_keys, kr, zero), torch.where(tile.used_keys, vr, zero)
    qf = fold(q[:, :, row.q0 : row.q1], hkv)  # (B, Hkv, group * n, D)
    if tile is not None and tile.hidden_rows is not None:  # junk (NaN) in queries that see no key here
        qf = torch.where(tile.hidden_rows[..., None], q.new_zeros(()), qf)
    return qf, kr, vr, tile


def flip_rows(t: torch.Tensor, group: int) -> torch.Tensor:
    """Reverse the query order within each head of folded rows ``(B, Hkv, group * n, ...)``."""
    b, hkv, rows = t.shape[:3]
    return t.reshape(b, hkv, group, rows // group, *t.shape[3:]).flip(3).reshape(t.shape)


def band_mask(
    call: TileCall, sel: Select, row: RowBlock, run: Run, tile: Tile | None, hq: int, hkv: int
) -> torch.Tensor:
    """The additive mask of one run for the fused engine: the bias (and -inf where the tile hides),
    laid out like folded queries ``(Bm or 1, Hkv, g*n, S)`` *in reversed query order*.

    A bias of ``kv_idx - q_idx`` alone is constant along the diagonals of a tile; with the rows
    reversed it is constant along its anti-diagonals, which a strided view of the band with row
    and column strides 1 reads without a copy (callers reverse the queries with
    :func:`flip_rows`, and the outputs back).
    """
    band = call.band
    assert band is not None, "band_mask is for calls with TileCall.band"
    if band.shape[0] > 1 and sel.h_idx is not None and sel.q_heads is not None:
        band = band.index_select(0, sel.h_idx.view(-1)).contiguous()  # the group's query heads
    heads, width = band.shape
    group = hq // hkv
    n, span = row.q1 - row.q0, run.k1 - run.k0
    # reversed row r holds query q1 - 1 - r: its key k0 + c is at kv - q = k0 - q1 + 1 + r + c
    first = run.k0 - row.q1 + 1 + (call.prepared.q_len - 1)  # column of (r, c) = (0, 0)
    if heads == 1:  # one band for every head
        view = band.as_strided((1, 1, n, span), (width, width, 1, 1), band.storage_offset() + first)
        view = view.repeat(1, 1, group, 1) if group > 1 else view
    else:
        view = band.as_strided(
            (heads // group, group, n, span), (group * width, width, 1, 1), band.storage_offset() + first
        )
        view = view.reshape(1, heads // group, group * n, span)  # a view when group == 1
    if tile is None:
        return view
    return view.masked_fill(~flip_rows(tile.allowed, group), NEG_INF)


def bias_tile(call: TileCall, sel: Select, row: RowBlock, run: Run, hq: int, hkv: int) -> torch.Tensor | None:
    """The bias of one run, laid out like the folded queries ``(Bs or 1, Hkv, g*n, S)``; None without bias."""
    if call.bias is None:
        return None
    assert sel.b_idx is not None and sel.h_idx is not None, "select(..., indexed=True) for a bias"
    device = sel.b_idx.device
    q_idx = torch.arange(row.q0, row.q1, device=device).view(1, 1, -1, 1)
    kv_idx = torch.arange(run.k0, run.k1, device=device).view(1, 1, 1, -1)
    t = as4d(call.bias.elements(sel.b_idx, sel.h_idx, q_idx, kv_idx, call.prepared.q_len, call.prepared.kv_len))
    t = t.expand(*t.shape[:2], row.q1 - row.q0, run.k1 - run.k0)  # (Bs or 1, Hs or 1, n, S)
    return fold_tile(t, hq, hkv)


def scores(
    call: TileCall,
    qf: torch.Tensor,
    kr: torch.Tensor,
    tile: Tile | None,
    bias_tile: torch.Tensor | None = None,
    keep_capped: bool = False,
    where: tuple[Select, RowBlock, Run] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Scores of one run in float32/64, and ``tanh(s / softcap)`` if ``keep_capped`` (else None).

    With a score_mod, ``where = (sel, row, run)`` places the tile; then the scores before
    it are returned third (for the backward pass), else None.
    """
    ct = compute_dtype(qf.dtype)
    pre = call.scale if call.softcap is None else call.scale / call.softcap  # applied to q: n x D, not n x S
    finfo = torch.finfo(ct)
    if pre != 0.0 and not finfo.tiny <= abs(pre) <= finfo.max:  # scale / softcap is no normal float: two roundings
        s = torch.matmul(qf.to(ct) * call.scale, kr.to(ct).transpose(-2, -1)).div_(call.softcap)  # type: ignore[arg-type]
    else:
        s = torch.matmul(qf.to(ct) * pre, kr.to(ct).transpose(-2, -1))  # (B, Hkv, g*n, S)
    capped = None
    if call.softcap is not None:
        s = s.tanh_()
        if keep_capped:
            capped, s = s, s * call.softcap
        else:
            s = s.mul_(call.softcap)
    if bias_tile is not None:
        s = s.add_(bias_tile.to(ct))
    before = None
    if call.score_mod is not None:
        assert where is not None, "a score_mod needs where=(sel, row, run)"
        before, s = s, score_mod_tile(call, s, *where)
    if tile is not None:
        if bias_tile is not None or call.score_mod is not None:  # may hold NaN or +inf where hidden: overwrite
            s = s.masked_fill_(~tile.allowed, NEG_INF)
        else:
            s = s.add_(tile.additive)  # 0 / -inf: a broadcast add is faster than masked_fill_ here
    return s, capped, before


def score_mod_tile(call: TileCall, s: torch.Tensor, sel: Select, row: RowBlock, run: Run) -> torch.Tensor:
    """``score_mod`` on a folded tile ``(B, Hkv, g*n, S)``: unfolded to ``(Bs, Hs, n, S)`` for the
    function, with the tile's index tensors, and folded back."""
    assert call.score_mod is not None and sel.b_idx is not None and sel.h_idx is not None
    hkv, hq = s.shape[1], sel.h_idx.shape[1]
    device = s.device
    q_idx = torch.arange(row.q0, row.q1, device=device).view(1, 1, -1, 1)
    kv_idx = torch.arange(run.k0, run.k1, device=device).view(1, 1, 1, -1)
    out = call.score_mod(unfold(s, hq), sel.b_idx, sel.h_idx, q_idx, kv_idx)  # (Bs, Hs, n, S)
    return fold(out.to(s.dtype), hkv)


#: exp() of float32 values below about -87.3 is subnormal, and so are the products of
#: weights near that with values in the next matmul: x86 CPUs compute subnormals
#: 20-70x slower. Weights below exp(-60) = 9e-27 of the row's largest are kept at that
#: floor (far below float32's resolution); hidden pairs are still exactly 0.
EXP_FLOOR = -60.0


def weights(s: torch.Tensor, shift: torch.Tensor, tile: Tile | None) -> torch.Tensor:
    """``exp(s - shift)`` in place, hidden pairs and scores of -inf exactly 0 (the softmax numerator;
    the floor would give a score of -inf the weight exp(-60))."""
    minus_inf = s == NEG_INF if s.dtype == torch.float32 else None
    s = s.sub_(shift)
    if minus_inf is not None:
        s = s.clamp_(min=EXP_FLOOR)
    p = s.exp_()
    if minus_inf is not None:
        p = p.masked_fill_(minus_inf, 0.0)
    return p if tile is None else p.mul_(tile.allowed)


#: Rows of one math-engine tile. The planner merges row blocks with equal runs into one
#: (the fused engine tiles inside); the math engine materialises rows x keys, so it
#: walks merged blocks this many rows at a time.
MATH_ROWS = 128


def math_rows(rows: Iterable[RowBlock]) -> Iterator[RowBlock]:
    """Row blocks cut to at most :data:`MATH_ROWS` queries (for the math engine)."""
    for row in rows:
        if row.q1 - row.q0 <= MATH_ROWS:
            yield row
        else:
            for q0 in range(row.q0, row.q1, MATH_ROWS):
                yield RowBlock(q0, min(q0 + MATH_ROWS, row.q1), row.runs)


def group_inputs(
    sel: Select, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch rows and heads of one group of ``q``, ``k`` and ``v``."""
    q = take(take(q, 0, sel.batch), 1, sel.q_heads)
    k = take(take(k, 0, sel.batch), 1, sel.kv_heads)
    v = take(take(v, 0, sel.batch), 1, sel.kv_heads)
    return q, k, v


def put_rows(dst: torch.Tensor, sel: Select, src: torch.Tensor) -> None:
    """Write one group's result ``src`` into the whole output ``dst``."""
    if sel.q_heads is None:
        put(dst, 0, sel.batch, src)
    else:
        part = take(dst, 0, sel.batch)
        put(part, 1, sel.q_heads, src)
        if sel.batch is not None and not isinstance(sel.batch, tuple):
            dst.index_copy_(0, sel.batch, part)
