"""Exact statistics of the attention weights, tile by tile: the math kernel's
:meth:`~attnkit.kernels.contract.Kernel.stats`.

Each block of query rows is walked twice over the tiles the plan keeps: the first sweep finds the
row's largest score ``m`` and its sum ``l = sum exp(s - m)`` (with a sink, ``l + exp(sink - m)``), the
second forms every weight as ``exp((s - m) - log l)`` and reduces it (entropy, largest weight, mass
on the first keys, mean distance, mass each key receives, top-k keys) in O(L) memory, without the
``Lq x Lk`` matrix. Subtracting ``m`` and ``log l`` one after the other keeps the rounding of a
large log-sum-exp out of the weights: a float32 lse near 80 is off by up to 4e-6, and
``exp(s - lse)`` would pass that on to every weight of its row as a relative error.
"""

from __future__ import annotations

import torch

from attnkit.kernels import blocks
from attnkit.kernels.blocks import Run
from attnkit.kernels.contract import Call, StatsRequest
from attnkit.kernels.runs import tiles
from attnkit.plan import PreparedMask

__all__ = ["STATS_KEYS", "reduce"]

#: Keys per tile of the statistics pass: a tile is (B, H, 128 rows, at most this many keys).
#: The pass makes several elementwise sweeps over each tile; at 2048 keys they run
#: 1.3x faster than at 4096 (less memory traffic), and smaller tiles pay more Python
#: per tile (benchmarks/long_context.py, 2 cores).
STATS_KEYS = 2048


class _Accumulator:
    """The statistics of one group of (sequence, head) rows, filled tile by tile."""

    def __init__(self, lse, kv_len: int, sink_tokens: int, topk: int, qpos, kpos):
        bs, hs, lq = lse.shape
        dt, dev = qpos.dtype, lse.device
        self.entropy = torch.zeros(bs, hs, lq, dtype=dt, device=dev)
        self.max_weight = torch.zeros(bs, hs, lq, dtype=dt, device=dev)
        self.argmax = torch.full((bs, hs, lq), -1, dtype=torch.int64, device=dev)
        self.sink_mass = torch.zeros(bs, hs, lq, dtype=dt, device=dev)
        self.mean_distance = torch.zeros(bs, hs, lq, dtype=dt, device=dev)
        self.received = torch.zeros(bs, hs, kv_len, dtype=dt, device=dev)
        self.topk = topk
        if topk:
            self.topk_weights = torch.zeros(bs, hs, lq, topk, dtype=dt, device=dev)
            self.topk_keys = torch.full((bs, hs, lq, topk), -1, dtype=torch.int64, device=dev)
        self.sink_tokens, self.qpos, self.kpos = sink_tokens, qpos, kpos

    def add(self, w: torch.Tensor, d: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> None:
        """Reduce one tile: ``w`` the weights, ``d = log w`` where w > 0, ``(Bs, Hs, n, S)``."""
        rows = slice(q0, q1)
        self.entropy[..., rows] -= torch.einsum("bhij,bhij->bhi", w, d)
        top, where = _row_max(w)
        better = top > self.max_weight[..., rows]
        self.max_weight[..., rows] = torch.where(better, top, self.max_weight[..., rows])
        self.argmax[..., rows] = torch.where(better, where + k0, self.argmax[..., rows])
        if k0 < self.sink_tokens:
            self.sink_mass[..., rows] += w[..., : self.sink_tokens - k0].sum(-1)
        # sum_j w |p - j| with positions (Bp, n) and (Bj, S), Bp and Bj 1 or the group's rows:
        # one matrix product where the tile lies on one side of every query
        p, j = self.qpos[:, rows], self.kpos[:, k0:k1]
        before, after = bool(j.amax() <= p.amin()), bool(j.amin() >= p.amax())
        if before or after:
            ones_j = torch.stack([torch.ones_like(j), j], dim=-1)[:, None]  # (Bj, 1, S, 2)
            sums = w @ ones_j  # (Bs, Hs, n, 2): sum_j w, sum_j w j
            signed = p[:, None] * sums[..., 0] - sums[..., 1]
            self.mean_distance[..., rows] += signed if before else -signed
        elif p.shape[0] == 1 and j.shape[0] == 1:
            self.mean_distance[..., rows] += torch.einsum("bhij,ij->bhi", w, (p[0, :, None] - j[0, None, :]).abs())
        else:
            distance = (p[:, :, None] - j[:, None, :]).abs()[:, None]  # (B, 1, n, S)
            self.mean_distance[..., rows] += (w * distance).sum(-1)
        self.received[..., k0:k1] += w.sum(-2)
        if self.topk:
            vals, idx = _row_topk(w, self.topk)
            vals = torch.cat([self.topk_weights[..., rows, :], vals], dim=-1)
            idx = torch.cat([self.topk_keys[..., rows, :], idx + k0], dim=-1)
            best, pick = vals.topk(self.topk, dim=-1)
            self.topk_weights[..., rows, :] = best
            self.topk_keys[..., rows, :] = torch.where(best > 0, idx.gather(-1, pick), -1)


#: Scores of one block of rows kept from the statistics' first sweep for their second (32 MiB in
#: float32); past that the second sweep computes them again.
KEPT_SCORES = 1 << 23


#: Keys per sub-block when looking for a row's largest weights (see :func:`_row_max`).
_SUB = 64


def _row_max(w: torch.Tensor):
    """``w.max(-1)`` (value, index) by way of sub-block maxima: finding the index is
    several times slower than the maximum, so it is found in the winning sub-block only."""
    s = w.shape[-1]
    if s % _SUB or s <= _SUB:
        return w.max(dim=-1)
    blocks = w.view(*w.shape[:-1], s // _SUB, _SUB)
    top, block = blocks.amax(-1).max(dim=-1)  # (..., n)
    inside = blocks.gather(-2, block[..., None, None].expand(*block.shape, 1, _SUB)).squeeze(-2)
    return top, block * _SUB + inside.argmax(-1)


def _row_topk(w: torch.Tensor, k: int):
    """``w.topk(k, -1)`` (values, indices), padded with 0 / -1 past ``S`` keys. The k largest
    weights lie in the k sub-blocks with the largest maxima, so only those are searched."""
    s = w.shape[-1]
    if s % _SUB or s <= k * _SUB:
        kk = min(k, s)
        vals, idx = w.topk(kk, dim=-1)
        if kk < k:
            pad = (*w.shape[:-1], k - kk)
            vals = torch.cat([vals, w.new_zeros(pad)], -1)
            idx = torch.cat([idx, torch.full(pad, -1, dtype=idx.dtype, device=idx.device)], -1)
        return vals, idx
    blocks = w.view(*w.shape[:-1], s // _SUB, _SUB)
    _, chosen = blocks.amax(-1).topk(k, dim=-1)  # (..., n, k)
    cand = blocks.gather(-2, chosen[..., None].expand(*chosen.shape, _SUB))  # (..., n, k, SUB)
    keys = chosen[..., None] * _SUB + torch.arange(_SUB, device=w.device)
    vals, pick = cand.flatten(-2).topk(k, dim=-1)
    return vals, keys.flatten(-2).gather(-1, pick)


def reduce(call: Call, prepared: PreparedMask, request: StatsRequest) -> dict[str, torch.Tensor]:
    """The statistics of a 4-D call and its row log-sum-exp (the sinks' mass included): two
    sweeps over the plan's kept tiles for each block of rows (see the module)."""
    q, k, v = call.q, call.k, call.v
    sink_tokens, topk = request.sink_tokens, request.topk
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    ct = tiles.compute_dtype(q.dtype)
    # a row that sees no key: lse -inf, or the sink's logit (its only outcome)
    if call.sinks is None:
        lse = torch.full((b, hq, lq), float("-inf"), dtype=ct, device=q.device)
        sinks = None
    else:
        sinks = call.sinks.to(q.device, ct).view(1, hq, 1).expand(b, hq, lq)
        lse = sinks.clone()
    qpos, kpos = request.qpos.to(q.device, ct), request.kpos.to(q.device, ct)
    tcall = tiles.TileCall.reduction(call, prepared)
    out = {
        "entropy": torch.zeros(b, hq, lq, dtype=ct, device=q.device),
        "max_weight": torch.zeros(b, hq, lq, dtype=ct, device=q.device),
        "argmax": torch.full((b, hq, lq), -1, dtype=torch.int64, device=q.device),
        "sink_mass": torch.zeros(b, hq, lq, dtype=ct, device=q.device),
        "mean_distance": torch.zeros(b, hq, lq, dtype=ct, device=q.device),
        "received": torch.zeros(b, hq, lk, dtype=ct, device=q.device),
    }
    if topk:
        out["topk_weights"] = torch.zeros(b, hq, lq, topk, dtype=ct, device=q.device)
        out["topk_keys"] = torch.full((b, hq, lq, topk), -1, dtype=torch.int64, device=q.device)
    if lq and lk:
        for gi, group in enumerate(blocks.groups(prepared)):
            sel = tiles.select(
                group, prepared, b, hq, hkv, q.device, call.bias is not None or call.score_mod is not None
            )
            qg, kg, vg = tiles.group_inputs(sel, q, k, v)
            lse_g = tiles.take(tiles.take(lse, 0, sel.batch), 1, sel.q_heads)
            sinks_g = None if sinks is None else tiles.take(tiles.take(sinks, 0, sel.batch), 1, sel.q_heads)
            qpos_g, kpos_g = (pos if pos.shape[0] == 1 else tiles.take(pos, 0, sel.batch) for pos in (qpos, kpos))
            acc = _Accumulator(lse_g, lk, sink_tokens, topk, qpos_g, kpos_g)
            lse_g = lse_g.clone()
            _walk(tcall, gi, group, sel, qg, kg, vg, sinks_g, lse_g, acc)
            tiles.put_rows(lse, sel, lse_g)
            for name in out:
                tiles.put_rows(out[name], sel, getattr(acc, name))
    return {"lse": lse, **out}


def _walk(tcall, gi, group, sel, q, k, v, sinks, lse, acc: _Accumulator) -> None:
    """For each block of rows, its largest score and sum (writing the row's lse into ``lse``), then
    every kept tile's weights ``exp((s - m) - log l)`` fed to ``acc``."""
    hq, hkv = q.shape[1], k.shape[1]
    for row in tiles.math_rows(group.rows):
        if not row.runs:
            continue
        chunks = [
            Run(k0, min(k0 + STATS_KEYS, run.k1), run.full)
            for run in row.runs
            for k0 in range(run.k0, run.k1, STATS_KEYS)
        ]

        def scores(chunk):
            qf, kr, _, tile = tiles.run_inputs(tcall, gi, sel, q, k, v, row, chunk)
            bias_tile = tiles.bias_tile(tcall, sel, row, chunk, hq, hkv)
            return tiles.scores(tcall, qf, kr, tile, bias_tile, where=(sel, row, chunk))[0]  # (Bs, Hkv, g*n, S)

        # sweep 1: m and l (total) of each row, online over the chunks; the first chunks' scores are
        # kept for sweep 2 up to KEPT_SCORES elements, the rest computed again there
        m = total = None
        kept: list[torch.Tensor] = []
        room = KEPT_SCORES
        for i, chunk in enumerate(chunks):
            s = scores(chunk)
            top = s.amax(-1, keepdim=True)
            m_new = top if m is None else torch.maximum(m, top)
            shift = torch.where(m_new != float("-inf"), m_new, torch.zeros_like(m_new))  # a row with no key yet: 0
            keep = s.numel() <= room and len(kept) == i
            part = tiles.weights(s.clone() if keep else s, shift, None).sum(-1, keepdim=True)
            total = part if m is None or total is None else total.mul_(torch.exp(m - shift)).add_(part)
            m = m_new
            if keep:
                kept.append(s)
                room -= s.numel()
        assert m is not None and total is not None
        live = m != float("-inf")  # NaN stays NaN (a NaN query's row), as in the weights
        m = torch.where(live, m, torch.zeros_like(m))
        if sinks is not None:  # the sink is one more outcome of the row, its logit maybe the largest
            sink = tiles.fold(sinks[:, :, row.q0 : row.q1, None], hkv)
            top = torch.where(live, torch.maximum(m, sink), m)
            total = torch.where(live, total * torch.exp(m - top) + torch.exp(sink - top), total)
            m = top
        log_l = torch.where(live, total.log(), torch.zeros_like(total))
        lse[:, :, row.q0 : row.q1] = torch.where(
            tiles.unfold(live, hq), tiles.unfold(m + log_l, hq), lse[:, :, row.q0 : row.q1, None]
        ).squeeze(-1)
        # sweep 2: the weights, reduced
        for i, chunk in enumerate(chunks):
            s = kept[i] if i < len(kept) else scores(chunk)
            d = s.sub_(m).sub_(log_l)  # log-weights (<= 0 up to rounding), -inf for pairs that get no weight
            counted = d > tiles.EXP_FLOOR  # below exp(-60) of the row's mass a weight is 0
            d = d.clamp_(min=tiles.EXP_FLOOR, max=0.0)
            w = torch.exp(d).mul_(counted)
            acc.add(tiles.unfold(w, hq), tiles.unfold(d, hq), row.q0, row.q1, chunk.k0, chunk.k1)
