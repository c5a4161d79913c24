"""Exact attention statistics at any length, without the ``Lq x Lk`` matrix.

With the row log-sum-exp of a forward pass, every weight is ``exp(s - lse)``; so one
more pass over the tiles the prepared mask keeps can reduce them (entropy, largest
weight, mass on the first keys, mean distance, mass each key receives, top-k keys)
in O(L) memory. This is how :func:`attnkit.capture` records long inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from attnkit._validate import AttnkitTypeError, AttnkitValueError, check_nonnegative_int
from attnkit.bias import BiasLike
from attnkit.functional import validated_call
from attnkit.kernels import native, registry, tiles
from attnkit.prepare import MaskLike, Run
from attnkit.score_mods import ScoreModLike

__all__ = ["AttentionStats", "attention_stats"]

#: Keys per tile of the statistics pass: a tile is (B, H, 128 rows, at most this many keys).
#: The pass makes several elementwise sweeps over each tile; at 2048 keys they run
#: 1.3x faster than at 4096 (less memory traffic), and smaller tiles pay more Python
#: per tile (benchmarks/long_context.py, 2 cores).
STATS_KEYS = 2048


@dataclass(frozen=True)
class AttentionStats:
    """Statistics of the attention weights of one call; shapes ``(B, H, Lq)`` unless noted.

    - ``lse``: row log-sum-exp of the scores (``-inf`` for a row with every key masked);
    - ``entropy``: of each row's weights, in nats (with ``sinks``, the sink's weight counts
      as one more outcome); :attr:`entropy_bits` gives it in bits, the unit the views print;
    - ``max_weight`` and ``argmax``: the largest weight and its key (``-1`` for a fully
      masked row);
    - ``sink_mass``: weight on the first ``sink_tokens`` keys;
    - ``mean_distance``: ``sum_j w_ij |p(i) - k(j)|`` with the mask's positions
      (:meth:`attnkit.masks.Mask.positions`: each sequence's own inside a KV cache);
    - ``received (B, H, Lk)``: each key's total weight over all queries;
    - ``topk_keys`` / ``topk_weights (B, H, Lq, topk)``: the largest weights of each row,
      largest first (keys ``-1`` / weights 0 where a row has fewer allowed keys); None
      when ``topk=0``.

    A fully masked row has lse ``-inf`` and 0 everywhere else. All values are float32
    (float64 for float64 inputs) and exact to that precision.
    """

    lse: torch.Tensor
    entropy: torch.Tensor
    max_weight: torch.Tensor
    argmax: torch.Tensor
    sink_mass: torch.Tensor
    mean_distance: torch.Tensor
    received: torch.Tensor
    topk_keys: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None

    @property
    def valid(self) -> torch.Tensor:
        """``(B, H, Lq)`` bool: rows that attend to at least one key."""
        return torch.isfinite(self.lse)

    @property
    def entropy_bits(self) -> torch.Tensor:
        """``entropy`` in bits (``entropy / ln 2``): the unit every attnkit view, figure and
        summary prints (a row spread evenly over n keys has log2(n) bits)."""
        return self.entropy / math.log(2.0)

    def head_summary(self) -> dict[str, torch.Tensor]:
        """Per-head means over the batch and the rows that attend: ``{name: (H,)}``.

        Names: ``entropy``, ``max_weight``, ``sink_mass``, ``mean_distance``.
        """
        valid = self.valid.to(self.entropy.dtype)
        count = valid.sum(dim=(0, 2)).clamp_min(1)
        return {
            name: (getattr(self, name) * valid).sum(dim=(0, 2)) / count
            for name in ("entropy", "max_weight", "sink_mass", "mean_distance")
        }

    def to(self, *args: Any, **kwargs: Any) -> AttentionStats:
        """Every tensor moved/cast with ``Tensor.to`` (``argmax`` and ``topk_keys`` keep int64)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if t is None:
                out[f.name] = None
            elif t.is_floating_point():
                out[f.name] = t.to(*args, **kwargs)
            else:
                device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
                out[f.name] = t if device is None else t.to(device)
        return AttentionStats(**out)


def _positions(mask, q_len: int, kv_len: int, device, dtype):
    """Key-axis positions ``(B or 1, Lq)`` and ``(B or 1, Lk)`` of the queries and keys
    (:meth:`attnkit.masks.Mask.positions`; bottom-right alignment for masks without any)."""
    found = None if mask is None else mask.positions(q_len, kv_len, device)
    if found is None:
        found = (torch.arange(q_len, device=device)[None] + (kv_len - q_len), torch.arange(kv_len, device=device)[None])
    return found[0].to(device, dtype), found[1].to(device, dtype)


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


def attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskLike = None,
    *,
    scale: float | None = None,
    attn_bias: BiasLike = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    score_mod: ScoreModLike = None,
    sink_tokens: int = 1,
    topk: int = 0,
) -> AttentionStats:
    """Exact statistics of the attention weights, in O(L) memory (see :class:`AttentionStats`).

    The arguments are :func:`attnkit.attention`'s (inputs of rank 2 to 4). One forward
    pass gives the lse, a second pass over the tiles the mask keeps reduces the
    weights ``exp(s - lse)``; no tensor of ``Lq x Lk`` elements is made (a tile holds
    ``128 x 2048`` pairs per head at most). ``v`` is checked, not used.

    >>> import torch, attnkit
    >>> from attnkit.inspect import attention_stats
    >>> q = k = v = torch.randn(1, 2, 6, 8)
    >>> st = attention_stats(q, k, v, attnkit.masks.causal(), topk=2)
    >>> st.entropy.shape, st.received.shape, st.topk_keys.shape
    (torch.Size([1, 2, 6]), torch.Size([1, 2, 6]), torch.Size([1, 2, 6, 2]))
    >>> st.argmax[0, 0, 0].item()  # the first query sees only the first key
    0
    """
    sink_tokens = check_nonnegative_int(sink_tokens, "sink_tokens")
    topk = check_nonnegative_int(topk, "topk")
    if isinstance(mask, torch.Tensor) and mask.is_floating_point():
        raise AttnkitTypeError(
            "attention_stats takes bool masks or mask objects; pass an additive float mask as "
            "attn_bias=attnkit.bias.dense(tensor) (and -inf entries as a bool mask)."
        )
    call = validated_call(q, k, v, mask, scale, 0.0, True, attn_bias, softcap, sinks, score_mod)
    squeeze = q.dim() - 4
    if squeeze > 0:
        raise AttnkitValueError(f"attention_stats takes inputs of rank 2 to 4, but q has shape {tuple(q.shape)}.")
    q4, k4, v4 = (t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) for t in (q, k, v))
    call = validated_call(q4, k4, v4, _lift(call.mask, q.dim()), scale, 0.0, True, attn_bias, softcap, sinks, score_mod)
    with torch.no_grad():
        if call.q.device.type == "cpu" and call.q.dtype != torch.float64 and not registry.refusals("native", call):
            stats = _on_the_engine(call, sink_tokens, topk)
        else:
            plan = registry.choose(call)
            _, lse = registry.run(call, plan)  # includes the sinks' mass
            assert lse is not None, "return_lse was asked for"
            stats = _reduce(call, lse, sink_tokens, topk)
    if q.dim() < 4:
        lifted: dict[str, Any] = {}
        for f in fields(stats):
            t = getattr(stats, f.name)
            lifted[f.name] = None if t is None else t.reshape(t.shape[4 - q.dim() :])
        stats = AttentionStats(**lifted)
    return stats


def _lift(mask, rank: int):
    """A bool tensor mask of rank-2/3 inputs, lined up with the 4-D call."""
    if isinstance(mask, torch.Tensor):
        return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask
    return mask


def _on_the_engine(call, sink_tokens: int, topk: int) -> AttentionStats:
    """The statistics from the native engine's own two passes (``torch.ops.attnkit.native_stats``)."""
    lq, lk = call.q.shape[2], call.k.shape[2]
    qpos, kpos = _positions(call.mask_object(), lq, lk, call.q.device, torch.float32)
    out = native.stats(call, qpos, kpos, sink_tokens, topk)
    return AttentionStats(**_with_sink_entropy(call, out))


def _with_sink_entropy(call, out: dict) -> dict:
    """``out`` with the sink's own term in each row's entropy (the sink is one more outcome)."""
    if call.sinks is not None:
        lse = out["lse"]
        w_sink = torch.exp(call.sinks.to(lse.dtype).view(-1, 1) - lse)
        w_sink = torch.where(torch.isfinite(lse), w_sink, torch.zeros_like(w_sink))
        out = {**out, "entropy": out["entropy"] + torch.special.xlogy(w_sink, w_sink).neg()}
    return out


def _reduce(call, lse: torch.Tensor, sink_tokens: int, topk: int) -> AttentionStats:
    q, k, v = call.q, call.k, call.v
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    ct = tiles.compute_dtype(q.dtype)
    lse = lse.to(ct)
    prepared = call.get_prepared()
    qpos, kpos = _positions(call.mask_object(), lq, lk, q.device, ct)
    tcall = tiles.TileCall(
        prepared,
        call.scale,
        0.0,
        0,
        "math",
        call.bias,
        call.softcap,
        tuple(call.bias.params()) if call.bias is not None else (),
        score_mod=call.score_mod,
    )
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
        for gi, group in enumerate(prepared.groups):
            sel = tiles.select(
                group, prepared, b, hq, hkv, q.device, call.bias is not None or call.score_mod is not None
            )
            qg, kg, vg = tiles.group_inputs(sel, q, k, v)
            lse_g = tiles.take(tiles.take(lse, 0, sel.batch), 1, sel.q_heads)
            qpos_g, kpos_g = (pos if pos.shape[0] == 1 else tiles.take(pos, 0, sel.batch) for pos in (qpos, kpos))
            acc = _Accumulator(lse_g, lk, sink_tokens, topk, qpos_g, kpos_g)
            _walk(tcall, gi, group, sel, qg, kg, vg, lse_g, acc)
            for name in out:
                tiles.put_rows(out[name], sel, getattr(acc, name))
    return AttentionStats(**_with_sink_entropy(call, {"lse": lse, **out}))


def _walk(tcall, gi, group, sel, q, k, v, lse, acc: _Accumulator) -> None:
    """Feed every kept tile's weights ``exp(s - lse)`` to ``acc``."""
    hq, hkv = q.shape[1], k.shape[1]
    for row in tiles.math_rows(group.rows):
        if not row.runs:
            continue
        lf = tiles.fold(lse[:, :, row.q0 : row.q1, None], hkv)  # (Bs, Hkv, g*n, 1)
        lf = torch.where(torch.isfinite(lf), lf, torch.zeros_like(lf))
        for run in row.runs:
            for k0 in range(run.k0, run.k1, STATS_KEYS):
                chunk = Run(k0, min(k0 + STATS_KEYS, run.k1), run.full)
                qf, kr, _, tile = tiles.run_inputs(tcall, gi, sel, q, k, v, row, chunk)
                bias_tile = tiles.bias_tile(tcall, sel, row, chunk, hq, hkv)
                s, _, _ = tiles.scores(tcall, qf, kr, tile, bias_tile, where=(sel, row, chunk))  # (Bs, Hkv, g*n, S)
                d = s.sub_(lf)  # log-weights (<= 0 up to rounding), -inf for pairs that get no weight
                counted = d > tiles.EXP_FLOOR  # below exp(-60) of the row's mass a weight is 0
                d = d.clamp_(min=tiles.EXP_FLOOR, max=0.0)
                w = torch.exp(d).mul_(counted)
                acc.add(tiles.unfold(w, hq), tiles.unfold(d, hq), row.q0, row.q1, chunk.k0, chunk.k1)
