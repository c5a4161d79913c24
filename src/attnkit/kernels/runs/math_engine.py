"""The math engine of the walk: one run as matmul, softmax statistics and matmul, in PyTorch,
forward and backward (the ``math`` kernel's engine, and the fused engine's backward where
PyTorch's fused backward computes too little: the gradients of the lse or of a bias's tensors).

A run is walked at most :data:`~attnkit.kernels.runs.tiles.MATH_ROWS` queries at a time, with the
statistics in float32 (float64 for float64 inputs): any bias (evaluated one tile at a time, with
the gradients of its own tensors), soft-capping, any ``score_mod`` (autograd on each tile),
dropout (a keep-mask drawn per run from a generator seeded once per call), Dv != D, float64, any
device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnkit.kernels.blocks import Group, RowBlock, Run, Square
from attnkit.kernels.runs import tiles
from attnkit.kernels.runs.tiles import Grads, Pair, Tensor

__all__ = ["ENGINE", "MathEngine", "dropout_keep_mask"]


def dropout_keep_mask(
    call: tiles.TileCall, gi: int, row: RowBlock, run: Run, shape: Sequence[int], device: torch.device
) -> torch.Tensor:
    """Dropout keep-mask of one run (folded rows, ``shape = (B, Hkv, g*n, S)``): the same on every
    call with the same seed; tests rebuild a call's whole keep-mask from it."""
    g = torch.Generator(device=device)
    g.manual_seed((call.seed + 7_919 * gi + 1_000_003 * row.q0 + run.k0) % (2**63))
    return torch.rand(shape, generator=g, device=device) >= call.dropout_p


def _math_backward_row(
    call: tiles.TileCall, gi, sel: tiles.Select, q, k, v, row: RowBlock, go, lf, grad_lse, delta, dk, dv, grads
):
    """The math backward pass for one row block: returns its folded dQ, adds to dK/dV.

    ``dS = P (dP - delta)`` with ``delta = rowsum(P dP)`` summed over the row's runs (the
    softmax's own backward, as the naive formula computes it: with one key dS is exactly 0),
    lowered by ``grad_lse`` (``d lse / d s = P``). When the row's runs hold all its keys
    (``call.own_lse``), ``P`` is renormalised from the row's own scores rather than taken as
    ``exp(S - lse)``, whose float32 lse carries ``|max score| x 6e-8`` of rounding into every
    weight. Ring attention's parts (``backward_part``) hold some of the keys: they pass
    ``delta = rowsum(dO O)`` of the merged output and use the merged lse. Each run's tiles
    are kept until the row is done: ``rows x (keys of the row)`` values, as in the forward.
    """
    hq, hkv = q.shape[1], k.shape[1]
    ct = go.dtype
    scored = []
    for run in row.runs:
        qf, kr, vr, tile = tiles.run_inputs(call, gi, sel, q, k, v, row, run)
        s, capped, before = tiles.scores(
            call, qf, kr, tile, tiles.bias_tile(call, sel, row, run, hq, hkv), keep_capped=True, where=(sel, row, run)
        )
        scored.append((run, qf, kr, vr, tile, s, capped, before))
    if call.own_lse:
        m = torch.stack([s.amax(dim=-1) for *_, s, _, _ in scored]).amax(dim=0)[..., None]  # (B, Hkv, g*n, 1)
        shift = m.masked_fill(m == tiles.NEG_INF, 0.0)
    else:
        shift = lf[..., None]
    own_delta = delta is None
    pieces = []
    total: torch.Tensor | float = 0.0
    delta = 0.0 if own_delta else delta
    for run, qf, kr, vr, tile, s, capped, before in scored:
        p = tiles.weights(s, shift, tile)  # (B, Hkv, g*n, S)
        if tile is not None and tile.hidden_rows is not None:
            p = p.masked_fill(tile.hidden_rows[..., None], 0.0)
        if call.own_lse:
            total = total + p.sum(dim=-1, keepdim=True)
        pieces.append((run, qf, kr, vr, p, capped, before))
    if call.own_lse:
        inv = 1.0 / torch.where(torch.as_tensor(total) == 0, 1.0, torch.as_tensor(total))
    done = []
    for run, qf, kr, vr, p, capped, before in pieces:
        if call.own_lse:
            p = p.mul_(inv)
        dp = go @ vr.to(ct).transpose(-2, -1)  # (B, Hkv, g*n, Dv) x (B, Hkv, Dv, S)
        pd = p
        if call.dropout_p > 0.0:
            keep = dropout_keep_mask(call, gi, row, run, p.shape, q.device).to(ct) / (1.0 - call.dropout_p)
            pd, dp = p * keep, dp * keep
        if own_delta:
            delta = delta + (p * dp).sum(dim=-1, keepdim=True)  # (B, Hkv, g*n, 1)
        done.append((run, qf, kr, p, pd, dp, capped, before))
    if grad_lse is not None:
        delta = delta - grad_lse
    dqf: torch.Tensor | None = None  # (B, Hkv, g*n, D), summed over the runs in place
    for run, qf, kr, p, pd, dp, capped, before in done:
        keys = slice(run.k0, run.k1)
        dv[:, :, keys] += pd.transpose(-2, -1) @ go
        ds = p * (dp - delta)  # d loss / d (modified score)
        ds = torch.where(p == 0, 0.0, ds)  # a hidden pair has no gradient, whatever delta holds (NaN)
        if before is not None:  # through the score_mod: d loss / d (scores before it), and its params
            ds = _score_mod_backward(call, sel, row, run, before, ds, grads)
        if call.bias_grad:
            index = (
                sel.b_idx,
                sel.h_idx,
                torch.arange(row.q0, row.q1, device=q.device).view(1, 1, -1, 1),
                torch.arange(run.k0, run.k1, device=q.device).view(1, 1, 1, -1),
            )
            assert call.bias is not None and sel.b_idx is not None and sel.h_idx is not None
            call.bias.add_grad(
                grads, tiles.unfold(ds, hq), sel.b_idx, sel.h_idx, *index[2:], call.prepared.q_len, call.prepared.kv_len
            )
        if capped is not None:
            ds = ds * (1.0 - capped * capped)  # d (c tanh(s / c)) / ds
        ds = ds * call.scale
        part = ds @ kr.to(ct)
        dqf = part if dqf is None else dqf.add_(part)
        dk[:, :, keys] += ds.transpose(-2, -1) @ qf.to(ct)
    assert dqf is not None, "a row block with runs"
    return dqf


def _score_mod_backward(call: tiles.TileCall, sel, row: RowBlock, run: Run, before, ds, grads):
    """The vector-Jacobian product of the score_mod on one tile (autograd on the tile alone); the
    gradients of its params are added to ``grads`` (by tensor id)."""
    assert call.score_mod is not None
    wanted = [t for t in call.score_mod.params if t.requires_grad]
    with torch.enable_grad():
        x = before.detach().requires_grad_()
        y = tiles.score_mod_tile(call, x, sel, row, run)
        found = torch.autograd.grad(y, [x, *wanted], ds, allow_unused=True)
    for t, g in zip(wanted, found[1:]):
        if g is not None:
            grads[id(t)] = g if id(t) not in grads else grads[id(t)] + g
    return torch.zeros_like(ds) if found[0] is None else found[0]


class MathEngine:
    """The math walk's parts (see :class:`attnkit.kernels.runs.walk.Engine`)."""

    name = "math"

    def forward_whole(self, call: tiles.TileCall, q: Tensor, k: Tensor, v: Tensor) -> Pair | None:
        return None

    def steps(self, call: tiles.TileCall, gi: int, group: Group, sel: tiles.Select, q: Tensor, k: Tensor) -> list:
        return list(tiles.math_rows(group.rows))

    def forward_run(
        self, call: tiles.TileCall, gi: int, sel: tiles.Select, q: Tensor, k: Tensor, v: Tensor, row: RowBlock, run: Run
    ) -> Pair:
        qf, kr, vr, tile = tiles.run_inputs(call, gi, sel, q, k, v, row, run)
        bias_tile = tiles.bias_tile(call, sel, row, run, q.shape[1], k.shape[1])
        s, _, _ = tiles.scores(call, qf, kr, tile, bias_tile, where=(sel, row, run))
        m = s.amax(dim=-1, keepdim=True)
        dead = m == tiles.NEG_INF  # rows with no finite score here (hidden, or a -inf bias on every key)
        m = m.masked_fill(dead, 0.0)
        p = tiles.weights(s, m, tile)  # one exp pass: unnormalised weights
        if call.may_empty_rows:  # the exp floor would give those rows weights exp(-60)
            p = p.masked_fill_(dead, 0.0)
        total = p.sum(dim=-1, keepdim=True)
        lse_r = (m + total.log()).squeeze(-1)  # -inf where every key is hidden
        if call.dropout_p > 0.0:
            p = p * dropout_keep_mask(call, gi, row, run, p.shape, q.device) / (1.0 - call.dropout_p)
        o = (p @ vr.to(p.dtype)).div_(torch.where(total == 0, 1.0, total))  # (B, Hkv, g*n, S) x (B, Hkv, S, Dv)
        return o, lse_r

    def forward_square(self, call: tiles.TileCall, sq: Square, q: Tensor, k: Tensor, v: Tensor) -> Pair:
        raise AssertionError("the math engine plans no causal squares")

    def backward_whole(
        self,
        call: tiles.TileCall,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        grad_out: Tensor,
        grad_lse: Tensor | None,
    ) -> Grads | None:
        return None

    def backward_group(
        self,
        call: tiles.TileCall,
        gi: int,
        group: Group,
        sel: tiles.Select,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        grad_out: Tensor,
        grad_lse: Tensor | None,
        grads: dict,
    ) -> Grads:
        lse_safe = torch.where(lse == tiles.NEG_INF, 0.0, lse)
        hq, hkv = q.shape[1], k.shape[1]
        ct = tiles.compute_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=ct, device=q.device)
        dk = torch.zeros(k.shape, dtype=ct, device=q.device)
        dv = torch.zeros(v.shape, dtype=ct, device=q.device)
        for row in tiles.math_rows(group.rows):
            if not row.runs:
                continue
            rows = slice(row.q0, row.q1)
            go = tiles.fold(grad_out[:, :, rows], hkv).to(ct)  # (B, Hkv, g*n, Dv)
            lf = tiles.fold(lse_safe[:, :, rows, None], hkv)[..., 0]  # (B, Hkv, g*n)
            gl = None if grad_lse is None else tiles.fold(grad_lse[:, :, rows, None].to(ct), hkv)
            # the row's delta from its own weights, or (the keys being a part) from the merged output
            delta = None if call.own_lse else (go * tiles.fold(out[:, :, rows], hkv).to(ct)).sum(-1, keepdim=True)
            dqf = _math_backward_row(call, gi, sel, q, k, v, row, go, lf, gl, delta, dk, dv, grads)
            dq[:, :, rows] = tiles.unfold(dqf, hq)
        return dq, dk, dv


ENGINE = MathEngine()
