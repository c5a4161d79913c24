"""The gradient rule's reduction of the weights, tile by tile: the math kernel's
:meth:`~attnkit.kernels.contract.Kernel.relevance`.

With the row log-sum-exp of the call's forward, every weight is ``exp(s - lse)``. A float32 lse
is rounded by up to half an ulp of ``|lse|``, an error common to its row's weights (none on a
softmax's largest weight): a first pass over a row's tiles sums its weights (and the sink's), and the
row's weights are divided by that sum (1 but for the rounding). The pass over the tiles the plan
keeps then forms, per tile, ``dA = dO V^T`` (the gradient of a target with respect
to the weights), ``(dA * A)^+`` averaged over the chosen heads (or the weights ``A`` alone: rollout),
and adds the rows' vectors ``r`` times it to each key's relevance (see
:class:`~attnkit.kernels.contract.RelevanceRequest`), in O(L) memory. Row blocks whose ``r`` is 0 are skipped.
"""

from __future__ import annotations

import torch

from attnkit.kernels import blocks
from attnkit.kernels.blocks import Run
from attnkit.kernels.contract import Call, RelevanceRequest
from attnkit.kernels.runs import tiles
from attnkit.plan import PreparedMask

__all__ = ["KEYS", "reduce"]

#: Keys per tile: a tile is (B, H, 128 rows, at most this many keys), as the statistics' pass.
KEYS = 2048


def reduce(call: Call, prepared: PreparedMask, request: RelevanceRequest) -> torch.Tensor:
    """``(B, R, Lk)``: ``sum_i r[:, :, i] sum_h w_h (dA * A)^+`` (``A`` alone without ``d_out``) over the
    plan's kept tiles."""
    q, k, v = call.q, call.k, call.v
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    ct = tiles.compute_dtype(q.dtype)
    r = request.r.to(q.device, ct)
    d_out = None if request.d_out is None else request.d_out.to(q.device, ct)
    lse, head_weights = request.lse.to(q.device, ct), request.head_weights.to(q.device, ct)
    total = torch.zeros(b, r.shape[1], lk, dtype=ct, device=q.device)
    live = (r != 0).any(dim=1).any(dim=0).tolist() if lq and lk else []  # rows some r weights (one read)
    if not any(live):
        return total
    weighted = head_weights.tolist()
    tcall = tiles.TileCall.reduction(call, prepared)
    for gi, group in enumerate(blocks.groups(prepared)):
        heads = range(hq) if group.heads is None else group.heads
        if not any(weighted[h] for h in heads):
            continue  # no chosen head in the group
        sel = tiles.select(group, prepared, b, hq, hkv, q.device, call.bias is not None or call.score_mod is not None)
        qg, kg, vg = tiles.group_inputs(sel, q, k, v)
        lse_g = tiles.take(tiles.take(lse, 0, sel.batch), 1, sel.q_heads)
        d_g = None if d_out is None else tiles.take(tiles.take(d_out, 0, sel.batch), 1, sel.q_heads)
        w_g = tiles.take(head_weights, 0, sel.q_heads)
        r_g = tiles.take(r, 0, sel.batch)
        part = torch.zeros(r_g.shape[0], r.shape[1], lk, dtype=ct, device=q.device)
        sinks_g = None if call.sinks is None else tiles.take(call.sinks.to(q.device, ct), 0, sel.q_heads)
        _walk(tcall, gi, group, sel, qg, kg, vg, lse_g, d_g, w_g, r_g, live, part, sinks_g)
        tiles.put(total, 0, sel.batch, part, add=True)
    return total


def _walk(tcall, gi, group, sel, q, k, v, lse, d_out, head_weights, r, live, part, sinks) -> None:
    """Add every kept tile's ``r @ sum_h w_h (dA * A)^+`` to ``part (Bs, R, Lk)``."""
    hq, hkv = q.shape[1], k.shape[1]

    def weights(row, chunk, lf):
        qf, kr, vr, tile = tiles.run_inputs(tcall, gi, sel, q, k, v, row, chunk)
        bias_tile = tiles.bias_tile(tcall, sel, row, chunk, hq, hkv)
        s, _, _ = tiles.scores(tcall, qf, kr, tile, bias_tile, where=(sel, row, chunk))  # (Bs, Hkv, g*n, S)
        d = s.sub_(lf)
        counted = d > tiles.EXP_FLOOR  # below exp(-60) of the row's mass a weight is 0
        return d.clamp_(min=tiles.EXP_FLOOR, max=0.0).exp_().mul_(counted), vr

    for row in tiles.math_rows(group.rows):
        if not row.runs or not any(live[row.q0 : row.q1]):
            continue
        lse_rows = lse[:, :, row.q0 : row.q1, None]  # (Bs, Hs, n, 1)
        seen = torch.isfinite(lse_rows)
        lf = tiles.fold(torch.where(seen, lse_rows, torch.zeros_like(lse_rows)), hkv)  # no key seen: scores -inf
        df = None if d_out is None else tiles.fold(d_out[:, :, row.q0 : row.q1], hkv)  # (Bs, Hkv, g*n, Dv)
        r_rows = r[:, :, row.q0 : row.q1]  # (Bs, R, n)
        chunks = [Run(k0, min(k0 + KEYS, run.k1), run.full) for run in row.runs for k0 in range(run.k0, run.k1, KEYS)]
        mass = sum(weights(row, chunk, lf)[0].sum(-1, keepdim=True) for chunk in chunks)  # (Bs, Hkv, g*n, 1)
        if sinks is not None:
            sink = (sinks.view(1, -1, 1, 1) - lse_rows).exp().where(seen, torch.zeros_like(lse_rows))
            mass = mass + tiles.fold(sink, hkv)
        scale = torch.where(mass > 0, 1 / mass, torch.zeros_like(mass))  # the lse's rounding divided out
        for chunk in chunks:
            w, vr = weights(row, chunk, lf)
            w.mul_(scale)
            m = w if df is None else (df @ vr.transpose(-2, -1).to(df.dtype)).mul_(w).clamp_min_(0)  # (dA * A)^+
            per_head = tiles.unfold(m, hq)  # (Bs, Hs, n, S)
            mixed = torch.einsum("bhis,h->bis", per_head, head_weights)
            part[..., chunk.k0 : chunk.k1] += r_rows @ mixed
