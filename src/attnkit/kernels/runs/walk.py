"""The walk of a prepared mask by the PyTorch engines (the ``fused`` and ``math`` kernels).

For each group of batch rows (and heads) that share a block map (:mod:`attnkit.kernels.blocks`),
for each row block of queries, the *runs* of adjacent key blocks that are all FULL (no element
mask needed) or all PARTIAL (the mask tile read from the plan's bits). Each run is one exact
attention call of the engine that returns its output and row log-sum-exp; runs merge exactly by
log-sum-exp (:mod:`attnkit.kernels.lse`). Keys past a sequence's limit are never read. Nothing of
size ``Lq x Lk`` is allocated: the largest tile is ``bq x Lk``. Backward recomputes each run from
the saved log-sum-exp (FlashAttention's scheme). The engines are
:mod:`attnkit.kernels.runs.fused_engine` and :mod:`attnkit.kernels.runs.math_engine`.

Equivalent pytorch code: ``reference.attention(q, k, v, prepared.materialize(), scale=scale)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from attnkit._validate import AttnkitValueError
from attnkit.bias import band_of
from attnkit.kernels import blocks
from attnkit.kernels.blocks import Group, RowBlock, Run, Square
from attnkit.kernels.contract import double_backward_error
from attnkit.kernels.lse import merge
from attnkit.kernels.runs import aten, fused_engine, math_engine, tiles
from attnkit.kernels.runs.tiles import Grads, Pair, Tensor
from attnkit.plan import PreparedMask

if TYPE_CHECKING:
    from attnkit.bias import Bias
    from attnkit.score_mods import ScoreMod

__all__ = ["ENGINES", "Engine", "attention", "backward_part", "draw_seed", "forward", "backward"]


class Engine(Protocol):
    """One engine of the walk: how it computes a run, forward and backward."""

    name: str

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


#: The engines of the walk by name.
ENGINES: dict[str, Engine] = {"fused": fused_engine.ENGINE, "math": math_engine.ENGINE}


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


def forward(call: tiles.TileCall, q: Tensor, k: Tensor, v: Tensor) -> Pair:
    """``out: (B, Hq, Lq, Dv)`` and ``lse: (B, Hq, Lq)`` (-inf for fully masked rows)."""
    engine = ENGINES[call.engine]
    whole = engine.forward_whole(call, q, k, v)
    if whole is not None:
        return whole
    hq, hkv = q.shape[1], k.shape[1]
    b, _, lq, _ = q.shape
    if blocks.single(call.prepared):
        sel = tiles.select(blocks.groups(call.prepared)[0], call.prepared, b, hq, hkv, q.device, call.indexed)
        return _forward_group(call, engine, 0, blocks.groups(call.prepared)[0], sel, q, k, v)
    out = q.new_zeros(b, hq, lq, v.shape[-1])
    lse = torch.full((b, hq, lq), tiles.NEG_INF, dtype=tiles.compute_dtype(q.dtype), device=q.device)
    for gi, group in enumerate(blocks.groups(call.prepared)):
        sel = tiles.select(group, call.prepared, b, hq, hkv, q.device, call.indexed)
        og, lg = _forward_group(call, engine, gi, group, sel, *tiles.group_inputs(sel, q, k, v))
        tiles.put_rows(out, sel, og)
        tiles.put_rows(lse, sel, lg)
    return out, lse


def backward(
    call: tiles.TileCall,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    grad_lse: Tensor | None,
    grads: dict,
) -> Grads:
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
    if blocks.single(call.prepared):
        group = blocks.groups(call.prepared)[0]
        sel = tiles.select(group, call.prepared, b, hq, hkv, q.device, call.indexed)
        dq, dk, dv = engine.backward_group(call, 0, group, sel, q, k, v, out, lse, grad_out, grad_lse, grads)
        return dq.masked_fill(dead[..., None], 0.0).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    ct = tiles.compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    for gi, group in enumerate(blocks.groups(call.prepared)):
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
        out, lse = forward(call, q, k, v)
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
        dq, dk, dv = backward(call, q, k, v, out, lse, grad_out, grad_lse, grads)
        param_grads = []
        for t in call.params:  # a tensor the score_mod or bias never read keeps grad None, as in autograd
            g = grads.get(id(t)) if t.requires_grad else None
            param_grads.append(None if g is None else g.reshape(t.shape).to(t.dtype))
        return dq, dk, dv, None, *param_grads


def _band(engine: str, bias: Bias | None, band: torch.Tensor | None, q, k) -> torch.Tensor | None:
    """The fused engine's band of the bias, detached (its gradient is the math formula's)."""
    if engine != "fused" or bias is None:
        return None
    band = band_of(bias, q, k) if band is None else band
    return None if band is None else band.detach()


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
    band: torch.Tensor | None = None,
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
    ``band``: the bias as a band of ``kv - q`` (:func:`attnkit.bias.band_of`), which the fused
    engine adds as its mask (worked out here when not given).
    """
    if dropout_p > 0.0 and seed is None:
        seed = draw_seed()
    # one copy here rather than one per run: the fused engine needs unit-stride rows
    q, k, v = (aten.rows_contiguous(t) for t in (q, k, v))
    band = _band(engine, bias, band, q, k) if dropout_p == 0.0 and score_mod is None else None
    params = (() if bias is None else tuple(bias.params())) + (() if score_mod is None else score_mod.params)
    call = tiles.TileCall(
        prepared, scale, dropout_p, seed or 0, engine, bias, softcap, params, score_mod=score_mod, band=band
    )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *params)):
        return _TileAttention.apply(q, k, v, call, *params)
    out, lse = forward(call, q, k, v)
    if out.requires_grad:  # autograd followed a tensor the score_mod or bias reads that is not among its params
        raise AttnkitValueError(
            "the score_mod (or bias) reads a tensor that requires a gradient which attnkit did not find "
            "among the tensors it captures: name it, score_mod=attnkit.score_mods.ScoreMod(fn, tensor), so that "
            "it gets its gradient."
        )
    return out, lse


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
    band: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of attention over some of the keys, from the final ``out`` and ``lse``
    (:meth:`attnkit.kernels.Kernel.backward_part`), by the walk of ``engine``."""
    q, k, v = (aten.rows_contiguous(t) for t in (q, k, v))
    band = _band(engine, bias, band, q, k)
    call = tiles.TileCall(prepared, scale, 0.0, 0, engine, bias, softcap, (), own_lse=False, band=band)
    return backward(call, q, k, v, out, lse, grad_out, grad_lse, {})
