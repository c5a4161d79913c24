"""The fused engine of the walk: each run one call of PyTorch's fused CPU flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``, :mod:`attnkit.kernels.runs.aten`), a
partial run with its tile as the additive mask, merged by log-sum-exp. A bias of ``kv - q`` alone
is one band per head taken as the additive mask through a strided view
(:func:`attnkit.kernels.runs.tiles.band_mask`); stretches of row blocks that form a causal square
run as one ``is_causal`` call; an unmasked or SDPA-causal plan is one call. Its backward is one
fused backward per run, or the math engine's formula where the gradients of the lse or of a
bias's tensors are wanted (PyTorch's fused backward computes neither).
"""

from __future__ import annotations

import torch

from attnkit.kernels import blocks
from attnkit.kernels.blocks import Group, RowBlock, Run, Square
from attnkit.kernels.lse import merge
from attnkit.kernels.runs import aten, math_engine, tiles
from attnkit.kernels.runs.tiles import Grads, Pair, Tensor

__all__ = ["ENGINE", "FusedEngine", "available"]


def available(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether PyTorch's fused CPU kernel can run these inputs (it needs Dv == D)."""
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1] and aten.AVAILABLE


def _one_call(call: tiles.TileCall, q, k) -> bool | None:
    """``is_causal`` when one call of the fused kernel computes the whole result (no mask, or
    a causal one that is exactly SDPA's), else None. It returns the lse, which SDPA does not."""
    if call.bias is not None or not call.scale > 0.0:
        return None
    if q.shape[1] != k.shape[1] or q.shape[2] == 0 or k.shape[2] == 0:
        return None
    p = call.prepared
    if p.hides_nothing:
        return False
    if p.causal_shift == 0 and p.q_len <= p.kv_len:
        return True  # SDPA's top-left causal square (a ring's diagonal rectangle: equal, moved offsets)
    return None


class _Sums:
    """A gradient summed over runs along dim 2 without a zero fill: each position is copied on
    its first write and added to after; :meth:`done` zeroes what no run wrote."""

    def __init__(self, like: torch.Tensor, dtype: torch.dtype):
        self.t = torch.empty(like.shape, dtype=dtype, device=like.device)
        self.written = bytearray(like.shape[2])

    def add(self, i: int, j: int, src: torch.Tensor) -> None:
        seen, at = self.written, i
        while at < j:
            state = seen[at]
            end = seen.find(b"\x00" if state else b"\x01", at, j)
            end = j if end < 0 else end
            dst, part = self.t[:, :, at:end], src[:, :, at - i : end - i]
            dst.add_(part) if state else dst.copy_(part)
            at = end
        seen[i:j] = b"\x01" * (j - i)

    def done(self) -> torch.Tensor:
        seen, at, n = self.written, 0, len(self.written)
        while at < n:
            start = seen.find(b"\x00", at)
            if start < 0:
                break
            end = seen.find(b"\x01", start)
            end = n if end < 0 else end
            self.t[:, :, start:end] = 0.0
            at = end
        return self.t


def _backward_lse(lse: torch.Tensor) -> torch.Tensor:
    """The lse as PyTorch's fused backward needs it, with no host sync: 0 for a row that sees no
    key (its weights exp(s - 0) are then 0 under the -inf mask), and NaN for a row whose lse is +inf
    (an Inf that the row sees: its weights are NaN by the formula, where exp(s - inf) would give 0
    for the finite scores); a NaN lse stays NaN and makes the row's weights NaN."""
    return torch.where(lse == tiles.NEG_INF, 0.0, torch.where(lse == float("inf"), float("nan"), lse))


class FusedEngine:
    """The fused walk's parts (see :class:`attnkit.kernels.runs.walk.Engine`)."""

    name = "fused"

    def forward_whole(self, call: tiles.TileCall, q: Tensor, k: Tensor, v: Tensor) -> Pair | None:
        causal = _one_call(call, q, k)
        if causal is None:
            return None
        out, lse = aten.flash_forward(q, k, v, scale=call.scale, is_causal=causal)
        return out, lse.to(tiles.compute_dtype(q.dtype))

    def steps(self, call: tiles.TileCall, gi: int, group: Group, sel: tiles.Select, q: Tensor, k: Tensor) -> list:
        """The group's row blocks, with stretches that form a causal square as one :class:`Square`
        (no bias band, Hq == Hkv; :func:`attnkit.kernels.blocks.steps_with_squares`)."""
        if call.band is not None or q.shape[1] != k.shape[1]:
            return list(group.rows)
        return list(blocks.steps_with_squares(call.prepared, gi))

    def forward_run(
        self, call: tiles.TileCall, gi: int, sel: tiles.Select, q: Tensor, k: Tensor, v: Tensor, row: RowBlock, run: Run
    ) -> Pair:
        hq, hkv = q.shape[1], k.shape[1]
        qf, kr, vr, tile = tiles.run_inputs(call, gi, sel, q, k, v, row, run)
        if call.band is not None:  # the bias as the additive mask, in reversed query order
            per_kv = hq // hkv
            mask = tiles.band_mask(call, sel, row, run, tile, hq, hkv)
            o, lse_r = aten.flash_forward(tiles.flip_rows(qf, per_kv), kr, vr, attn_mask=mask, scale=call.scale)
            return tiles.flip_rows(o, per_kv), tiles.flip_rows(lse_r, per_kv)
        return aten.flash_forward(qf, kr, vr, attn_mask=None if tile is None else tile.additive, scale=call.scale)

    def forward_square(self, call: tiles.TileCall, sq: Square, q: Tensor, k: Tensor, v: Tensor) -> Pair:
        rows, square = slice(sq.a, sq.b), slice(sq.a, sq.b)
        parts = [aten.flash_forward(q[:, :, rows], k[:, :, square], v[:, :, square], scale=call.scale, is_causal=True)]
        if sq.c < sq.a:
            before = slice(sq.c, sq.a)
            parts.append(aten.flash_forward(q[:, :, rows], k[:, :, before], v[:, :, before], scale=call.scale))
        return merge(parts)

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
        causal = _one_call(call, q, k) if grad_lse is None else None
        if causal is None:
            return None
        return aten.flash_backward(
            grad_out.to(q.dtype).contiguous(),
            q,
            k,
            v,
            out.to(q.dtype),
            _backward_lse(lse).to(tiles.compute_dtype(q.dtype)),
            scale=call.scale,
            is_causal=causal,
        )

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
        """One fused backward call per run (or per causal square and its rectangle), summed into
        :class:`_Sums`; with a gradient of the lse or of the bias's tensors, the math formula."""
        # the math formula for what PyTorch's fused backward cannot compute: gradients of the lse
        # or of a bias's tensors
        if grad_lse is not None or call.bias_grad:
            return math_engine.ENGINE.backward_group(call, gi, group, sel, q, k, v, out, lse, grad_out, grad_lse, grads)
        lse_safe = _backward_lse(lse)
        hq, hkv = q.shape[1], k.shape[1]
        ct = tiles.compute_dtype(q.dtype)
        dq, dk, dv = _Sums(q, ct), _Sums(k, ct), _Sums(v, ct)
        per_kv = hq // hkv
        for row in self.steps(call, gi, group, sel, q, k):
            if isinstance(row, Square):  # as in the forward: the causal square and the rectangle before it
                rows, go = slice(row.a, row.b), grad_out[:, :, row.a : row.b].contiguous()
                of, lf = out[:, :, rows], lse_safe[:, :, rows]
                g_q, g_k, g_v = aten.flash_backward(
                    go, q[:, :, rows], k[:, :, rows], v[:, :, rows], of, lf, scale=call.scale, is_causal=True
                )
                dq.add(row.a, row.b, g_q)
                dk.add(row.a, row.b, g_k)
                dv.add(row.a, row.b, g_v)
                if row.c < row.a:
                    before = slice(row.c, row.a)
                    g_q, g_k, g_v = aten.flash_backward(
                        go, q[:, :, rows], k[:, :, before], v[:, :, before], of, lf, scale=call.scale
                    )
                    dq.add(row.a, row.b, g_q)
                    dk.add(row.c, row.a, g_k)
                    dv.add(row.c, row.a, g_v)
                continue
            if not row.runs:
                continue
            rows = slice(row.q0, row.q1)
            go = tiles.fold(grad_out[:, :, rows], hkv)  # (B, Hkv, g*n, Dv)
            lf = tiles.fold(lse_safe[:, :, rows, None], hkv)[..., 0]  # (B, Hkv, g*n)
            of = tiles.fold(out[:, :, rows], hkv)
            if call.band is not None:  # reversed query order: see tiles.band_mask
                go, of, lf = (tiles.flip_rows(t, per_kv) for t in (go, of, lf))
            go = go.contiguous()
            dqf: torch.Tensor | None = None  # (B, Hkv, g*n, D), summed over the runs in place
            for run in row.runs:
                qf, kr, vr, tile = tiles.run_inputs(call, gi, sel, q, k, v, row, run)
                mask: torch.Tensor | None
                if call.band is not None:
                    qf, mask = tiles.flip_rows(qf, per_kv), tiles.band_mask(call, sel, row, run, tile, hq, hkv)
                else:
                    mask = None if tile is None else tile.additive
                g_q, g_k, g_v = aten.flash_backward(go, qf, kr, vr, of, lf, attn_mask=mask, scale=call.scale)
                dqf = g_q.to(ct) if dqf is None else dqf.add_(g_q)
                dk.add(run.k0, run.k1, g_k)
                dv.add(run.k0, run.k1, g_v)
            assert dqf is not None, "a row block with runs"
            if call.band is not None:
                dqf = tiles.flip_rows(dqf, per_kv)
            dq.add(row.q0, row.q1, tiles.unfold(dqf, hq))
        return dq.done(), dk.done(), dv.done()


ENGINE = FusedEngine()
