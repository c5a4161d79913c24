"""What attnkit's block-sparse CPU kernels share: when block sparsity pays, and the plan walk of
the two PyTorch engines.

The kernels are ``native`` (:mod:`attnkit.kernels.native`, C++), ``fused``
(:mod:`attnkit.kernels.fused`, PyTorch's flash CPU op per run) and ``math``
(:mod:`attnkit.kernels.tiled_math`, matmul and softmax per run); the registry chooses among
them (``kernel="tiled"`` names the three). This module holds:

- :func:`sparse_pays`: the decision each of them takes in its ``prefers`` with its own
  :class:`Limits` (how much of the mask a plan may keep before the dense mask is faster);
- the walk of a :class:`~attnkit.prepare.PreparedMask` for the fused and math engines: for each
  group of batch rows (and heads) that share a block map, for each row block of queries, the
  *runs* of adjacent key blocks that are all FULL (no element mask needed) or all PARTIAL (the
  mask evaluated on that tile only). Each run is one exact attention call that returns its
  output and row log-sum-exp; runs merge exactly by log-sum-exp. Keys past a sequence's limit
  are never read. Nothing of size ``Lq x Lk`` is allocated: the largest tile is ``bq x Lk``.
  Backward recomputes each run from the saved log-sum-exp (FlashAttention's scheme);
- the custom ops through which compiled code runs that walk, with the plan as tensor arguments.

The engine of a walk is the kernel the registry chose (``TileCall.engine``); each engine module
registers its group functions in :data:`ENGINES`.

Equivalent pytorch code: ``reference.attention(q, k, v, prepared.materialize(), scale=scale)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from attnkit.kernels import _aten, sdpa, tiles
from attnkit.kernels.lse import merge
from attnkit.kernels.registry import Call, Reason, double_backward_error
from attnkit.prepare import Group, PreparedMask, RowBlock, Run, rebuilt

if TYPE_CHECKING:
    from attnkit.bias import Bias
    from attnkit.score_mods import ScoreMod

__all__ = [
    "BLOCK_SIZE",
    "ENGINES",
    "LIMITS",
    "Limits",
    "Square",
    "as4d",
    "attention",
    "backward_part",
    "compiled_forward",
    "sparse_pays",
]

#: The block size of the CPU kernels' prepared masks (benchmarks/cpu.py).
BLOCK_SIZE = (128, 64)


# --- when block sparsity pays ----------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """A kernel's thresholds for masked calls, from benchmarks/cpu.py and core.py.

    - ``min_pairs``: below this many (query, key) pairs one dense call beats tiling a plan ...
    - ``min_keys``: ... unless the keys are many (decoding over a long padded cache reads only
      each sequence's own keys here);
    - ``padding_min_keys``: a mask that only cuts each sequence's keys (padding) from this many
      keys on (decoding: 1.3-6x faster than the dense mask at 128-1024 keys, batches of 1-64);
    - ``max_kept[(half precision, backward)]``: masked plans keeping at most this fraction of
      blocks; ``max_kept_full``: plans of full blocks (or causal squares and full blocks, a
      prefix-LM: 1.6-2x faster than the dense mask at 54-69% kept).
    """

    min_pairs: int = 256 * 256
    min_keys: int = 1024
    padding_min_keys: int = 128
    max_kept: tuple[tuple[tuple[bool, bool], float], ...] = (
        ((False, False), 0.85),
        ((False, True), 0.6),
        ((True, False), 0.6),
        ((True, True), 0.3),
    )
    max_kept_full: float = 0.85

    def kept_limit(self, half: bool, backward: bool) -> float:
        return dict(self.max_kept)[(half, backward)]


#: The thresholds of the fused and math kernels (and of the native one below its row limit).
LIMITS = Limits()


def sparse_pays(
    call: Call, limits: Limits = LIMITS, squares: Callable[[PreparedMask, Call], bool] | None = None
) -> tuple[bool, Reason]:
    """Whether a plain masked call (no score modification, dropout or lse) runs faster block-sparse
    than as SDPA's dense mask, and why, by ``limits``. ``squares(prepared, call)``: whether the plan
    runs as causal squares and full blocks (the fused engine's). Prepares the mask only where the
    answer needs its plan."""
    s = call.shapes
    if call.mask is None:
        return False, "no mask: SDPA's fused kernel"
    if call.causal_shift() == 0 and call.scale > 0.0:
        return False, "is_causal: SDPA's fused kernel"
    small = lambda: f"dense mask: Lq*Lk={call.pairs} is small"  # noqa: E731
    if call.tensor_mask and call.pairs < limits.min_pairs:
        return False, small
    if call.hides_nothing_here():
        return False, "the mask hides nothing here"
    limit = call.shared_key_limit()
    if limit is not None:
        return False, f"every sequence's keys end at {limit}: SDPA over those keys"
    if sdpa.per_sequence_limits(call) is not None:  # no mask, no copy, the keys past a limit unread
        return False, "each sequence's keys end at its own limit: SDPA over each one's keys (a call per limit)"
    padding = call.limit_only() and s.lk >= limits.padding_min_keys
    if call.pairs < limits.min_pairs and s.lk <= limits.min_keys and not padding:
        return False, small
    p = call.prepared_at(BLOCK_SIZE)
    if p.hides_nothing:
        return False, "the mask hides nothing here"
    if p.limit_only and p.kv_limit_value and s.rank == 4:
        return False, lambda: f"every sequence's keys end at {p.kv_limit_value}: SDPA over those keys"
    if not p.masked and p.kv_limit is not None:
        return True, lambda: f"{p.kept:.0%} of blocks kept, all full, keys past each sequence's end unread"
    if not p.masked and p.kept <= limits.max_kept_full:
        return True, lambda: f"{p.kept:.0%} of blocks kept, all full"
    if call.pairs < limits.min_pairs:
        return False, small
    if p.kept <= limits.kept_limit(call.half, call.backward):
        return True, lambda: f"{p.kept:.0%} of blocks kept"
    if p.kept <= limits.max_kept_full and squares is not None and squares(p, call):
        return True, lambda: f"{p.kept:.0%} of blocks kept: causal squares and full blocks"
    return False, lambda: f"{p.kept:.0%} of blocks kept: the dense mask is faster"


def modifications_in_words(call: Call, band: bool | None) -> str:
    """How a call's score modifications are applied, for explain (``band``: a bias as a band)."""
    parts = []
    if call.bias is not None:
        parts.append(f"attn_bias {'as a band of kv - q' if band else 'on each tile'}")
    if call.softcap is not None or call.score_mod is not None:
        parts.append("softcap/score_mod on each tile")
    if call.sinks is not None:
        parts.append("sinks from the lse")
    return ", ".join(parts)


def as4d(call: Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The call's q, k and v as (B, H, L, D) views."""
    lead = (1,) * (4 - call.shapes.rank)
    return tuple(t.reshape(*lead, *t.shape) for t in (call.q, call.k, call.v))  # type: ignore[return-value]


def compile_refusals(call: Call) -> list[str]:
    """Why a block-sparse kernel cannot run a call under torch.compile."""
    reasons = []
    if call.compiling:
        if not isinstance(call.mask, PreparedMask):
            reasons.append(
                "under torch.compile it reads a PreparedMask made outside the compiled function "
                "(attnkit.prepare); mask objects become dense masks in the graph"
            )
        if call.bias is not None or call.score_mod is not None or call.dropout_p > 0.0:
            reasons.append("under torch.compile: no attn_bias, score_mod or dropout (they run eagerly only)")
    return reasons


# --- the walk of the PyTorch engines ---------------------------------------------------------


Tensor = torch.Tensor
Pair = tuple[torch.Tensor, torch.Tensor]
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Square:
    """Row blocks ``[a, b)`` that see keys ``[c, a)`` entirely and ``[a, b)`` causally (a document's
    causal square, a prefix-LM's causal rows): one ``is_causal`` call of the fused kernel over the
    square and one unmasked call over the rectangle, instead of one call per row block."""

    a: int
    b: int
    c: int


class Engine(Protocol):
    """What an engine module registers in :data:`ENGINES`."""

    def forward_whole(self, call: tiles.TileCall, q: Tensor, k: Tensor, v: Tensor) -> Pair | None:
        """The whole call in one call of its own (None: walk the plan)."""

    def steps(self, call: tiles.TileCall, gi: int, group: Group, sel: tiles.Select, q: Tensor, k: Tensor) -> list:
        """The group's row blocks (and :class:`Square` s) in the order they are computed."""

    def forward_run(
        self, call: tiles.TileCall, gi: int, sel: tiles.Select, q: Tensor, k: Tensor, v: Tensor, row: RowBlock, run: Run
    ) -> Pair:
        """``(out, lse)`` of one run, folded rows ``(B, Hkv, g*n, Dv)`` / ``(B, Hkv, g*n)``."""

    def forward_square(self, call: tiles.TileCall, sq: Square, q: Tensor, k: Tensor, v: Tensor) -> Pair:
        """``(out, lse)`` of a :class:`Square`'s rows."""

    def backward_whole(
        self, call: tiles.TileCall, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
        grad_lse: Tensor | None,
    ) -> Grads | None:  # fmt: skip
        """``(dq, dk, dv)`` in one call of its own (None: walk the plan)."""

    def backward_group(
        self, call: tiles.TileCall, gi: int, group: Group, sel: tiles.Select, q: Tensor, k: Tensor, v: Tensor,
        out: Tensor, lse: Tensor, grad_out: Tensor, grad_lse: Tensor | None, grads: dict,
    ) -> Grads:  # fmt: skip
        """``(dq, dk, dv)`` of one group."""


#: The engines of the walk by name: "fused" and "math" (filled by their modules).
ENGINES: dict[str, Engine] = {}


def _forward_group(call: tiles.TileCall, engine: Engine, gi: int, group: Group, sel: tiles.Select, q, k, v):
    """``out: (B, Hq, Lq, Dv)`` and ``lse: (B, Hq, Lq)`` of one group's inputs."""
    b, hq, lq, _ = q.shape
    steps = engine.steps(call, gi, group, sel, q, k)
    single = len(steps) == 1 and isinstance(steps[0], RowBlock) and steps[0].q0 == 0 and steps[0].q1 == lq
    single = single and bool(steps[0].runs)
    out = lse = torch.empty(0)
    covered = False
    if not single:
        # row blocks are disjoint: where they cover every query, each row is written once below
        covered = sum(s.b - s.a if isinstance(s, Square) else s.q1 - s.q0 for s in steps) == lq
        lse_dtype = tiles.compute_dtype(q.dtype)
        if covered:
            out = q.new_empty(b, hq, lq, v.shape[-1])
            lse = torch.empty((b, hq, lq), dtype=lse_dtype, device=q.device)
        else:
            out = q.new_zeros(b, hq, lq, v.shape[-1])
            lse = torch.full((b, hq, lq), tiles.NEG_INF, dtype=lse_dtype, device=q.device)
    for row in steps:
        if isinstance(row, Square):
            o, lse_r = engine.forward_square(call, row, q, k, v)
            out[:, :, row.a : row.b] = o
            lse[:, :, row.a : row.b] = lse_r.to(lse.dtype)
            continue
        if not row.runs:  # every query of the block is fully masked
            if covered:
                out[:, :, row.q0 : row.q1] = 0.0
                lse[:, :, row.q0 : row.q1] = tiles.NEG_INF
            continue
        parts = []
        for run in row.runs:
            o, lse_r = engine.forward_run(call, gi, sel, q, k, v, row, run)
            tile = tiles.mask_tile(call, gi, sel, row, run, hq, k.shape[1], q.dtype, q.device)
            if tile is not None and tile.hidden_rows is not None:
                lse_r = lse_r.masked_fill(tile.hidden_rows, tiles.NEG_INF)  # rows this run hides entirely
                o = o.masked_fill(tile.hidden_rows[..., None], 0.0)
            parts.append((o, lse_r))
        o, lse_r = merge(parts)
        if single:  # one row block: its result is the output
            return tiles.unfold(o, hq).to(q.dtype), tiles.unfold(lse_r, hq)
        out[:, :, row.q0 : row.q1] = tiles.unfold(o, hq).to(q.dtype)
        lse[:, :, row.q0 : row.q1] = tiles.unfold(lse_r, hq)
    return out, lse


def _single(call: tiles.TileCall) -> bool:
    groups = call.prepared.groups
    return len(groups) == 1 and groups[0].batch is None and groups[0].heads is None


def _forward(call: tiles.TileCall, q, k, v):
    """``out: (B, Hq, Lq, Dv)`` and ``lse: (B, Hq, Lq)`` (-inf for fully masked rows)."""
    engine = ENGINES[call.engine]
    whole = engine.forward_whole(call, q, k, v)
    if whole is not None:
        return whole
    hq, hkv = q.shape[1], k.shape[1]
    b, _, lq, _ = q.shape
    if _single(call):
        sel = tiles.select(call.prepared.groups[0], call.prepared, b, hq, hkv, q.device, call.indexed)
        return _forward_group(call, engine, 0, call.prepared.groups[0], sel, q, k, v)
    out = q.new_zeros(b, hq, lq, v.shape[-1])
    lse = torch.full((b, hq, lq), tiles.NEG_INF, dtype=tiles.compute_dtype(q.dtype), device=q.device)
    for gi, group in enumerate(call.prepared.groups):
        sel = tiles.select(group, call.prepared, b, hq, hkv, q.device, call.indexed)
        og, lg = _forward_group(call, engine, gi, group, sel, *tiles.group_inputs(sel, q, k, v))
        tiles.put_rows(out, sel, og)
        tiles.put_rows(lse, sel, lg)
    return out, lse


def _backward(call: tiles.TileCall, q, k, v, out, lse, grad_out, grad_lse, grads):
    """``(dq, dk, dv)``; the gradients of the bias's and score_mod's tensors go into ``grads`` (by id)."""
    engine = ENGINES[call.engine]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    # rows that see no key (lse -inf: hidden, or emptied by a -inf bias or score_mod) get no gradient,
    # whatever their values read (the fused kernel computes 0 * dP for them, NaN where V holds NaN)
    dead = lse == tiles.NEG_INF
    grad_out = grad_out.masked_fill(dead[..., None], 0.0)
    grad_lse = None if grad_lse is None else grad_lse.masked_fill(dead, 0.0)
    whole = engine.backward_whole(call, q, k, v, out, lse, grad_out, grad_lse)
    if whole is not None:
        return whole[0].masked_fill(dead[..., None], 0.0), whole[1], whole[2]
    b, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
    if _single(call):
        group = call.prepared.groups[0]
        sel = tiles.select(group, call.prepared, b, hq, hkv, q.device, call.indexed)
        dq, dk, dv = engine.backward_group(call, 0, group, sel, q, k, v, out, lse, grad_out, grad_lse, grads)
        return dq.masked_fill(dead[..., None], 0.0).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    ct = tiles.compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    for gi, group in enumerate(call.prepared.groups):
        sel = tiles.select(group, call.prepared, b, hq, hkv, q.device, call.indexed)
        qg, kg, vg = tiles.group_inputs(sel, q, k, v)
        og = tiles.take(tiles.take(out, 0, sel.batch), 1, sel.q_heads)
        lg = tiles.take(tiles.take(lse, 0, sel.batch), 1, sel.q_heads)
        gg = tiles.take(tiles.take(grad_out, 0, sel.batch), 1, sel.q_heads)
        gl = None if grad_lse is None else tiles.take(tiles.take(grad_lse, 0, sel.batch), 1, sel.q_heads)
        g_q, g_k, g_v = engine.backward_group(call, gi, group, sel, qg, kg, vg, og, lg, gg, gl, grads)
        for dst, src, heads in ((dq, g_q, sel.q_heads), (dk, g_k, sel.kv_heads), (dv, g_v, sel.kv_heads)):
            if heads is None:
                tiles.put(dst, 0, sel.batch, src, add=True)
            else:
                part = tiles.take(dst, 0, sel.batch)
                tiles.put(part, 1, heads, src, add=True)
                if sel.batch is not None and not isinstance(sel.batch, tuple):
                    dst.index_copy_(0, sel.batch, part)
    return dq.masked_fill(dead[..., None], 0.0).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _TileAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: tiles.TileCall, *params):
        out, lse = _forward(call, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        call = ctx.call
        if torch.is_grad_enabled():  # create_graph=True: a second derivative is wanted
            raise double_backward_error(call.engine)
        q, k, v, out, lse = ctx.saved_tensors
        grads: dict = {}
        dq, dk, dv = _backward(call, q, k, v, out, lse, grad_out, grad_lse, grads)
        param_grads = []
        for t in call.params:
            g = grads.get(id(t)) if t.requires_grad else None
            if g is None and t.requires_grad:
                g = torch.zeros_like(t)
            param_grads.append(None if g is None else g.reshape(t.shape).to(t.dtype))
        return dq, dk, dv, None, *param_grads


def draw_seed() -> int:
    """One draw from the global generator that seeds a call's dropout."""
    return int(torch.randint(0, 2**62, (1,)).item())


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prepared: PreparedMask,
    *,
    engine: str,
    scale: float,
    dropout_p: float = 0.0,
    seed: int | None = None,
    bias: Bias | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention on 4-D inputs by the walk of ``engine`` ("fused" or "math");
    returns ``(out, lse)``.

    q: (B, Hq, Lq, D), k: (B, Hkv, Lk, D), v: (B, Hkv, Lk, Dv); ``prepared`` from
    :func:`attnkit.prepare` for these lengths. ``out: (B, Hq, Lq, Dv)``,
    ``lse: (B, Hq, Lq)`` in float32 (float64 for float64 inputs), -inf where a query
    may attend no key. Both are differentiable, as are the tensors of ``bias`` (an
    :class:`attnkit.bias.Bias`, evaluated one tile at a time). ``softcap`` caps the
    scaled scores with ``softcap * tanh(s / softcap)`` before the bias; ``score_mod`` (an
    :class:`attnkit.score_mods.ScoreMod`) modifies them after it, tile by tile, with gradients.
    """
    if dropout_p > 0.0 and seed is None:
        seed = draw_seed()
    # one copy here rather than one per run: the fused engine needs unit-stride rows
    q, k, v = (_aten.rows_contiguous(t) for t in (q, k, v))
    simple = dropout_p == 0.0 and score_mod is None
    band = tiles.band_for(bias, q, k) if simple and engine == "fused" else None
    params = (() if bias is None else tuple(bias.params())) + (() if score_mod is None else score_mod.params)
    call = tiles.TileCall(
        prepared, scale, dropout_p, seed or 0, engine, bias, softcap, params, score_mod=score_mod, band=band
    )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *params)):
        return _TileAttention.apply(q, k, v, call, *params)
    return _forward(call, q, k, v)


def backward_part(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prepared: PreparedMask,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None = None,
    *,
    engine: str,
    scale: float,
    bias: Bias | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of attention over some of the keys, from the final ``out`` and ``lse``
    (:meth:`attnkit.kernels.Kernel.backward_part`), by the walk of ``engine``."""
    q, k, v = (_aten.rows_contiguous(t) for t in (q, k, v))
    band = tiles.band_for(bias, q, k) if engine == "fused" else None
    call = tiles.TileCall(prepared, scale, 0.0, 0, engine, bias, softcap, (), own_lse=False, band=band)
    return _backward(call, q, k, v, out, lse, grad_out, grad_lse, {})


# --- under torch.compile: the walk as custom ops, the plan as tensors -------------------------------
#
# Compiled code cannot walk the host-side plan, so the walk runs as two custom ops whose eager
# implementations do. They take the plan's tensors (block codes, key limit, the partial blocks'
# bits) and its sizes as arguments, so a new PreparedMask of the same shapes runs the same
# compiled graph, and rebuild the host-side plan from them (a plan of ceil(Lq/bq) x ceil(Lk/bk)
# codes: microseconds). Their fake implementations give the output shapes.

_NONE = -(2**62)  # a band side without bound, as an int


def plan_arguments(prepared: PreparedMask) -> tuple:
    """``(codes, kv_limit, bits, tile_ids, sizes, band)``: a PreparedMask as the custom ops take it."""
    lo, hi = prepared.band if prepared.band is not None else (_NONE, _NONE)
    band = [int(prepared.band is not None), _NONE if lo is None else lo, _NONE if hi is None else hi]
    sizes = [prepared.q_len, prepared.kv_len, *prepared.block_size]
    bits, tile_ids = prepared.packed_partial_bits()
    return prepared.codes, prepared.kv_limit, bits, tile_ids, sizes, band


def _rebuilt(codes, kv_limit, bits, tile_ids, sizes, band) -> PreparedMask:
    lq, lk, bq, bk = sizes
    found = None
    if band[0]:
        found = (None if band[1] == _NONE else band[1], None if band[2] == _NONE else band[2])
    return rebuilt(lq, lk, (bq, bk), codes, kv_limit, bits, tile_ids, found)


@torch.library.custom_op("attnkit::tiled_forward", mutates_args=())
def compiled_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    codes: torch.Tensor,
    kv_limit: torch.Tensor | None,
    bits: torch.Tensor,
    tile_ids: torch.Tensor,
    sizes: list[int],
    band: list[int],
    engine: str,
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the fused or math walk for compiled code (``softcap`` 0: none)."""
    q, k, v = (_aten.rows_contiguous(t) for t in (q, k, v))
    prepared = _rebuilt(codes, kv_limit, bits, tile_ids, sizes, band)
    call = tiles.TileCall(prepared, scale, 0.0, 0, engine, None, softcap if softcap > 0.0 else None)
    with torch.no_grad():
        out, lse = _forward(call, q, k, v)
    return out.contiguous(), lse.contiguous()


@compiled_forward.register_fake
def _(q, k, v, codes, kv_limit, bits, tile_ids, sizes, band, engine, scale, softcap):
    b, hq, lq, _ = q.shape
    return q.new_empty(b, hq, lq, v.shape[-1]), q.new_empty(b, hq, lq, dtype=tiles.compute_dtype(q.dtype))


@torch.library.custom_op("attnkit::tiled_backward", mutates_args=())
def compiled_backward(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    codes: torch.Tensor,
    kv_limit: torch.Tensor | None,
    bits: torch.Tensor,
    tile_ids: torch.Tensor,
    sizes: list[int],
    band: list[int],
    engine: str,
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`compiled_forward`, recomputed from its saved lse."""
    q, k, v = (_aten.rows_contiguous(t) for t in (q, k, v))
    if grad_lse is not None and not bool(grad_lse.any()):  # compiled autograd hands an unused lse zeros:
        grad_lse = None  # without a gradient the fused engine runs its own backward (2x faster)
    prepared = _rebuilt(codes, kv_limit, bits, tile_ids, sizes, band)
    call = tiles.TileCall(prepared, scale, 0.0, 0, engine, None, softcap if softcap > 0.0 else None)
    dq, dk, dv = _backward(call, q, k, v, out, lse, grad_out, grad_lse, {})
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@compiled_backward.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, codes, kv_limit, bits, tile_ids, sizes, band, engine, scale, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_compiled(ctx, inputs, output):
    q, k, v, codes, kv_limit, bits, tile_ids, sizes, band, engine, scale, softcap = inputs
    ctx.save_for_backward(q, k, v, *output, codes, kv_limit, bits, tile_ids)
    ctx.scalars = (sizes, band, engine, scale, softcap)


def _compiled_grad(ctx, grad_out, grad_lse):
    q, k, v, out, lse, codes, kv_limit, bits, tile_ids = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    plan = (codes, kv_limit, bits, tile_ids)
    dq, dk, dv = compiled_backward(grad_out, grad_lse, q, k, v, out, lse, *plan, *ctx.scalars)
    return dq, dk, dv, *([None] * 9)


torch.library.register_autograd("attnkit::tiled_forward", _compiled_grad, setup_context=_setup_compiled)


def compiled_run(call: Call, engine: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A compiled call (its mask a PreparedMask) through :func:`compiled_forward`."""
    s = call.shapes
    q4, k4, v4 = as4d(call)
    assert isinstance(call.mask, PreparedMask), "compiled calls carry a PreparedMask"
    prepared = call.mask if call.mask.block_size == BLOCK_SIZE else call.prepared_at(BLOCK_SIZE)
    out, lse = compiled_forward(q4, k4, v4, *plan_arguments(prepared), engine, call.scale, call.softcap or 0.0)
    return out.reshape(s.out), lse.reshape(s.scores[:-1]) if call.return_lse else None


def rows_of(call: Call) -> int:
    """Query rows in all: B * Hq * Lq."""
    s = call.shapes
    return math.prod(s.batch) * s.hq * s.lq
