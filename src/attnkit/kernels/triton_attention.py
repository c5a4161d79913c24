"""A block-sparse FlashAttention-2 kernel in Triton that reads prepared masks as data.

One compiled kernel per dtype, head size and set of score modifications, never per
mask or shape: each program (one query block of one batch row and head) walks the
prepared mask's list of kept key blocks (``kv_num``/``kv_indices``). Full blocks need
no element mask. Inside partial blocks the mask is evaluated from its parameters for
the positional masks (causal and sliding windows with their offsets and alignment,
which covers the diagonal of every causal model), and read from precomputed bit
tiles of the partial blocks for every other mask (documents, prefixes, padding,
``&``/``|`` combinations, dense tensors, ``from_fn``): O(partial blocks) bytes, like
FlashMask's per-column ranges. Keys past each sequence's ``kv_limit`` are never read.

Score modifications: soft-capping and ALiBi (slopes per head, symmetric or causal)
in the kernel; sinks from the returned lse (the registry adds them). The backward
pass is one kernel per query block: dQ in registers, dK/dV by atomic adds in float32.

On CUDA this is the ``triton`` kernel of the registry. Under ``TRITON_INTERPRET=1``
Triton runs it on CPU tensors (slowly): that is how the tests check its logic on any
machine.
"""

from __future__ import annotations

import os

import torch

from attnkit import _cache
from attnkit import bias as _bias
from attnkit.kernels.registry import Call, Kernel, Reason

try:  # Triton is optional (the "gpu" extra)
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = tl = None
    AVAILABLE = False

__all__ = ["AVAILABLE", "TritonKernel", "interpreted", "triton_attention"]

#: Query and key block sizes (the prepared mask is made for these).
BLOCK_Q, BLOCK_K = 64, 64


#: Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, read at import as
#: Triton reads it): CPU tensors are allowed then.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1`` at import)."""
    return INTERPRETED


if AVAILABLE:

    @triton.jit
    def _scores(
        q,
        k,
        offs_m,
        offs_n,
        b,
        h,
        scale,
        softcap,
        slope,
        q_shift,
        kv_shift,
        lo_band,
        hi_band,
        limit,
        tile_ptr,
        tile_id,
        LQ,
        LK,
        BQ: tl.constexpr,
        BK: tl.constexpr,
        SOFTCAP: tl.constexpr,
        ALIBI: tl.constexpr,
        BAND: tl.constexpr,
        FP32: tl.constexpr,
    ):
        """The modified, masked scores of one tile (float32) and its keep mask."""
        if FP32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        if SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        # key-axis positions of the queries and keys (the mask's alignment and offsets)
        qp = (offs_m + q_shift)[:, None]
        kp = (offs_n + kv_shift)[None, :]
        if ALIBI == 1:
            s = s - slope * tl.abs(kp - qp).to(tl.float32)
        if ALIBI == 2:
            s = s + slope * (kp - qp).to(tl.float32)
        keep = (offs_m[:, None] < LQ) & (offs_n[None, :] < limit)
        if BAND:
            keep = keep & (kp >= qp - lo_band) & (kp <= qp + hi_band)
        listed = (tl.zeros([BQ, BK], tl.int32) + tile_id) >= 0
        bits = tl.load(
            tile_ptr + tile_id * BQ * BK + tl.arange(0, BQ)[:, None] * BK + tl.arange(0, BK)[None, :],
            mask=listed & keep,
            other=1,
        )
        keep = keep & (bits != 0)
        return tl.where(keep, s, float("-inf")), keep

    @triton.jit
    def _limit_and_slope(LIMIT, SLOPES, mb, h, LK, HAS_LIMIT: tl.constexpr, ALIBI: tl.constexpr):
        """The row's key limit (padding) and its head's ALiBi slope."""
        limit = LK
        if HAS_LIMIT:
            limit = tl.load(LIMIT + mb)
        slope = 0.0
        if ALIBI != 0:
            slope = tl.load(SLOPES + h)
        return limit, slope

    @triton.jit
    def _kv_tile(
        K,
        V,
        KV_IDX,
        TILE_IDS,
        at,
        b,
        hk,
        limit,
        skb,
        skh,
        skl,
        svb,
        svh,
        svl,
        offs_d,
        offs_dv,
        D,
        DV,
        BK: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """The listed key block at ``at``: its bit-tile id, key offsets, which keys exist, K and V."""
        kb = tl.load(KV_IDX + at)
        tile_id = tl.load(TILE_IDS + at)
        offs_n = kb * BK + tl.arange(0, BK)
        col_ok = offs_n < limit
        k = tl.load(
            K + b * skb + hk * skh + offs_n[:, None] * skl + offs_d[None, :],
            mask=col_ok[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        v = tl.load(
            V + b * svb + hk * svh + offs_n[:, None] * svl + offs_dv[None, :],
            mask=col_ok[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        return tile_id, offs_n, col_ok, k, v

    @triton.jit
    def _forward_kernel(
        Q,
        K,
        V,
        O,  # noqa: E741  (the output pointer, named as in the FlashAttention papers)
        LSE,
        KV_NUM,
        KV_IDX,
        TILE_IDS,
        TILES,
        LIMIT,
        SLOPES,
        sqb,
        sqh,
        sql,
        skb,
        skh,
        skl,
        svb,
        svh,
        svl,
        sob,
        soh,
        sol,
        s_nb,
        s_nh,
        s_nq,
        s_ib,
        s_ih,
        s_iq,
        HQ,
        GROUP,
        LQ,
        LK,
        D,
        DV,
        scale,
        softcap,
        q_shift,
        kv_shift,
        lo_band,
        hi_band,
        MASK_B: tl.constexpr,
        MASK_H: tl.constexpr,
        HAS_LIMIT: tl.constexpr,
        BQ: tl.constexpr,
        BK: tl.constexpr,
        BD: tl.constexpr,
        BDV: tl.constexpr,
        SOFTCAP: tl.constexpr,
        ALIBI: tl.constexpr,
        BAND: tl.constexpr,
        FP32: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        qb = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // HQ
        h = bh % HQ
        hk = h // GROUP
        mb = b * MASK_B
        mh = h * MASK_H
        offs_m = qb * BQ + tl.arange(0, BQ)
        offs_d = tl.arange(0, BD)
        offs_dv = tl.arange(0, BDV)
        q = tl.load(
            Q + b * sqb + h * sqh + offs_m[:, None] * sql + offs_d[None, :],
            mask=(offs_m[:, None] < LQ) & (offs_d[None, :] < D),
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        limit, slope = _limit_and_slope(LIMIT, SLOPES, mb, h, LK, HAS_LIMIT, ALIBI)
        m_i = tl.full([BQ], float("-inf"), tl.float32)
        l_i = tl.zeros([BQ], tl.float32)
        acc = tl.zeros([BQ, BDV], tl.float32)
        n = tl.load(KV_NUM + mb * s_nb + mh * s_nh + qb * s_nq)
        for t in range(0, n):
            tile_id, offs_n, _, k, v = _kv_tile(
                K,
                V,
                KV_IDX,
                TILE_IDS,
                mb * s_ib + mh * s_ih + qb * s_iq + t,
                b,
                hk,
                limit,
                skb,
                skh,
                skl,
                svb,
                svh,
                svl,
                offs_d,
                offs_dv,
                D,
                DV,
                BK,
                UPCAST,
            )
            s, keep = _scores(
                q,
                k,
                offs_m,
                offs_n,
                b,
                h,
                scale,
                softcap,
                slope,
                q_shift,
                kv_shift,
                lo_band,
                hi_band,
                limit,
                TILES,
                tile_id,
                LQ,
                LK,
                BQ,
                BK,
                SOFTCAP,
                ALIBI,
                BAND,
                FP32,
            )
            # a NaN score a row sees makes its max NaN (the formula's; max() alone would drop it)
            nan_here = tl.sum(tl.where(s != s, 1, 0), 1) > 0
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_new = tl.where(nan_here | (m_i != m_i), float("nan"), m_new)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.where(keep, tl.exp(s - m_use[:, None]), 0.0)
            alpha = tl.exp(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            if FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        seen = l_i > 0.0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        out = tl.where((l_i == 0.0)[:, None], 0.0, out)  # a row that sees no key: 0 (0 * NaN in V too)
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        lse = tl.where(l_i != l_i, float("nan"), lse)  # NaN where a score it sees is NaN, not -inf
        tl.store(
            O + b * sob + h * soh + offs_m[:, None] * sol + offs_dv[None, :],
            out.to(O.dtype.element_ty),
            mask=(offs_m[:, None] < LQ) & (offs_dv[None, :] < DV),
        )
        tl.store(LSE + bh * LQ + offs_m, lse, mask=offs_m < LQ)

    @triton.jit
    def _backward_kernel(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DQ,
        DK,
        DV_,
        KV_NUM,
        KV_IDX,
        TILE_IDS,
        TILES,
        LIMIT,
        SLOPES,
        sqb,
        sqh,
        sql,
        skb,
        skh,
        skl,
        svb,
        svh,
        svl,
        s_nb,
        s_nh,
        s_nq,
        s_ib,
        s_ih,
        s_iq,
        HQ,
        HKV,
        GROUP,
        LQ,
        LK,
        D,
        DV,
        scale,
        softcap,
        q_shift,
        kv_shift,
        lo_band,
        hi_band,
        MASK_B: tl.constexpr,
        MASK_H: tl.constexpr,
        HAS_LIMIT: tl.constexpr,
        BQ: tl.constexpr,
        BK: tl.constexpr,
        BD: tl.constexpr,
        BDV: tl.constexpr,
        SOFTCAP: tl.constexpr,
        ALIBI: tl.constexpr,
        BAND: tl.constexpr,
        FP32: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        qb = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // HQ
        h = bh % HQ
        hk = h // GROUP
        mb = b * MASK_B
        mh = h * MASK_H
        offs_m = qb * BQ + tl.arange(0, BQ)
        offs_d = tl.arange(0, BD)
        offs_dv = tl.arange(0, BDV)
        row_ok = offs_m < LQ
        q = tl.load(
            Q + b * sqb + h * sqh + offs_m[:, None] * sql + offs_d[None, :],
            mask=row_ok[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        do = tl.load(
            DO + bh * LQ * DV + offs_m[:, None] * DV + offs_dv[None, :],
            mask=row_ok[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(LSE + bh * LQ + offs_m, mask=row_ok, other=float("-inf"))
        empty = lse == float("-inf")  # rows that see no key: no gradient, whatever q or K/V hold
        lse = tl.where(empty, float("inf"), lse)  # every p is 0
        q = tl.where(empty[:, None], 0.0, q)
        delta = tl.load(DELTA + bh * LQ + offs_m, mask=row_ok, other=0.0)
        limit, slope = _limit_and_slope(LIMIT, SLOPES, mb, h, LK, HAS_LIMIT, ALIBI)
        dq = tl.zeros([BQ, BD], tl.float32)
        n = tl.load(KV_NUM + mb * s_nb + mh * s_nh + qb * s_nq)
        for t in range(0, n):
            tile_id, offs_n, col_ok, k, v = _kv_tile(
                K,
                V,
                KV_IDX,
                TILE_IDS,
                mb * s_ib + mh * s_ih + qb * s_iq + t,
                b,
                hk,
                limit,
                skb,
                skh,
                skl,
                svb,
                svh,
                svl,
                offs_d,
                offs_dv,
                D,
                DV,
                BK,
                UPCAST,
            )
            s, keep = _scores(
                q,
                k,
                offs_m,
                offs_n,
                b,
                h,
                scale,
                softcap,
                slope,
                q_shift,
                kv_shift,
                lo_band,
                hi_band,
                limit,
                TILES,
                tile_id,
                LQ,
                LK,
                BQ,
                BK,
                SOFTCAP,
                ALIBI,
                BAND,
                FP32,
            )
            p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
            if FP32:
                dv_part = tl.dot(tl.trans(p), do, input_precision="ieee")
                dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            else:
                dv_part = tl.dot(tl.trans(p).to(do.dtype), do)
                dp = tl.dot(do, tl.trans(v))
            ds = tl.where(keep, p * (dp - delta[:, None]), 0.0)  # hidden pairs: no gradient, even 0 * NaN
            if SOFTCAP:
                capped = s / softcap  # tanh of the capped score, where kept
                ds = ds * tl.where(keep, 1.0 - capped * capped, 0.0)
            ds = ds * scale
            if FP32:
                dq += tl.dot(ds, k, input_precision="ieee")
                dk_part = tl.dot(tl.trans(ds), q, input_precision="ieee")
            else:
                dq += tl.dot(ds.to(k.dtype), k)
                dk_part = tl.dot(tl.trans(ds).to(q.dtype), q)
            kv_rows = (b * HKV + hk) * LK + offs_n
            tl.atomic_add(
                DK + kv_rows[:, None] * D + offs_d[None, :], dk_part, mask=col_ok[:, None] & (offs_d[None, :] < D)
            )
            tl.atomic_add(
                DV_ + kv_rows[:, None] * DV + offs_dv[None, :], dv_part, mask=col_ok[:, None] & (offs_dv[None, :] < DV)
            )
        dq = tl.where(empty[:, None], 0.0, dq)
        tl.store(
            DQ + bh * LQ * D + offs_m[:, None] * D + offs_d[None, :], dq, mask=row_ok[:, None] & (offs_d[None, :] < D)
        )


# --- the mask and modifications as kernel arguments ---------------------------------------------


_BIG = 1 << 40


def _alibi(attn_bias):
    """The ALiBi bias when the kernel can compute it (int offsets), else None."""
    if not isinstance(attn_bias, _bias.Alibi):
        return None
    if isinstance(attn_bias.q_offset, torch.Tensor) or isinstance(attn_bias.kv_offset, torch.Tensor):
        return None
    return attn_bias


def _plan(call: Call):
    """The prepared mask at this kernel's block sizes and its element bits (``prepared.partial_bits``),
    through the one bounded cache: once per mask, lengths and device."""
    prepared = call.prepared_at(TritonKernel.block_size)
    if prepared.band is not None or prepared.mask is None:  # evaluated in the kernel from two ints
        store = _cache.plan_store(prepared)
        key = ("triton no bits", str(call.q.device))
        cached = store.get(key)
        if cached is None:
            cached = (
                torch.ones(1, BLOCK_Q, BLOCK_K, dtype=torch.int8, device=call.q.device),
                torch.full(prepared.kv_indices.shape, -1, dtype=torch.int32, device=call.q.device),
            )
            store.put(key, cached, cached[0].numel() + 4 * cached[1].numel())
        return prepared, cached
    return prepared, prepared.partial_bits(call.q.device)


def _next_pow2(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


class _Args:
    """Everything the two kernels take besides q, k, v."""

    def __init__(self, call: Call, q4, k4, v4):
        self.prepared, (self.bits, self.listed) = _plan(call)
        p = self.prepared
        b, hq, lq, d = q4.shape
        hkv, lk, dv = k4.shape[1], k4.shape[2], v4.shape[-1]
        self.shape = (b, hq, hkv, lq, lk, d, dv)
        self.scale = float(call.scale)
        self.has_softcap = call.softcap is not None
        self.softcap = float(call.softcap) if call.softcap is not None else 1.0
        alibi = _alibi(call.bias)
        self.alibi_mode = 0
        self.slopes = torch.zeros(1, device=q4.device, dtype=torch.float32)
        q_shift = kv_shift = 0  # the kernel's positions: qp = i + q_shift, kp = j + kv_shift
        if alibi is not None:
            self.alibi_mode = 2 if alibi.causal else 1
            self.slopes = alibi.slopes.detach().to(q4.device, torch.float32).contiguous()
            q_shift = alibi.q_offset + (lk - lq if alibi.align == "bottom_right" else 0)
            kv_shift = alibi.kv_offset
        self.band = p.band
        lo = hi = 0
        if p.band is not None:  # lo <= j - i <= hi, as kp - qp: j - i = kp - qp + q_shift - kv_shift
            offset = q_shift - kv_shift
            lo = _BIG if p.band[0] is None else -(p.band[0] - offset)
            hi = _BIG if p.band[1] is None else p.band[1] - offset
        self.positions = (q_shift, kv_shift, lo, hi)
        self.kv_num = p.kv_num.to(q4.device).contiguous()
        self.kv_idx = p.kv_indices.to(q4.device).contiguous()
        self.limit = p.kv_limit.to(q4.device, torch.int32).contiguous() if p.kv_limit is not None else self.kv_num
        self.mask_b = int(p.codes.shape[0] > 1)
        self.mask_h = int(p.codes.shape[1] > 1)

    def strides(self):
        n, i = self.kv_num.stride(), self.kv_idx.stride()
        return (n[0], n[1], n[2], i[0], i[1], i[2])

    def flags(self, q4):
        return dict(
            MASK_B=self.mask_b,
            MASK_H=self.mask_h,
            HAS_LIMIT=self.prepared.kv_limit is not None,
            BQ=BLOCK_Q,
            BK=BLOCK_K,
            BD=_next_pow2(self.shape[5]),
            BDV=_next_pow2(self.shape[6]),
            SOFTCAP=self.has_softcap,
            ALIBI=self.alibi_mode,
            BAND=self.band is not None,
            # Triton's interpreter computes bfloat16 dot products wrongly: upcast there
            FP32=q4.dtype == torch.float32 or self.upcast(q4),
            UPCAST=self.upcast(q4),
        )

    @staticmethod
    def upcast(q4) -> bool:
        return q4.dtype == torch.bfloat16 and interpreted()


def _forward(args: _Args, q4, k4, v4):
    b, hq, hkv, lq, lk, d, dv = args.shape
    out = torch.empty(b, hq, lq, dv, dtype=q4.dtype, device=q4.device)
    lse = torch.empty(b, hq, lq, dtype=torch.float32, device=q4.device)
    grid = (triton.cdiv(lq, BLOCK_Q), b * hq)
    _forward_kernel[grid](
        q4,
        k4,
        v4,
        out,
        lse,
        args.kv_num,
        args.kv_idx,
        args.listed,
        args.bits,
        args.limit,
        args.slopes,
        *q4.stride()[:3],
        *k4.stride()[:3],
        *v4.stride()[:3],
        *out.stride()[:3],
        *args.strides(),
        hq,
        hq // hkv,
        lq,
        lk,
        d,
        dv,
        args.scale,
        args.softcap,
        *args.positions,
        **args.flags(q4),
    )
    return out, lse


def _backward(args: _Args, q4, k4, v4, out, lse, grad_out, grad_lse):
    b, hq, hkv, lq, lk, d, dv = args.shape
    go = grad_out.contiguous()
    delta = (go.float() * out.float()).sum(-1)
    if grad_lse is not None:  # d lse / d s = p: lowers delta by the lse's gradient
        delta = delta - grad_lse.float()
    dq = torch.zeros(b, hq, lq, d, dtype=torch.float32, device=q4.device)
    dk = torch.zeros(b, hkv, lk, d, dtype=torch.float32, device=q4.device)
    dvv = torch.zeros(b, hkv, lk, dv, dtype=torch.float32, device=q4.device)
    grid = (triton.cdiv(lq, BLOCK_Q), b * hq)
    _backward_kernel[grid](
        q4,
        k4,
        v4,
        go,
        lse.contiguous(),
        delta.contiguous(),
        dq,
        dk,
        dvv,
        args.kv_num,
        args.kv_idx,
        args.listed,
        args.bits,
        args.limit,
        args.slopes,
        *q4.stride()[:3],
        *k4.stride()[:3],
        *v4.stride()[:3],
        *args.strides(),
        hq,
        hkv,
        hq // hkv,
        lq,
        lk,
        d,
        dv,
        args.scale,
        args.softcap,
        *args.positions,
        **args.flags(q4),
    )
    return dq.to(q4.dtype), dk.to(k4.dtype), dvv.to(v4.dtype)


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q4, k4, v4, args):
        out, lse = _forward(args, q4, k4, v4)
        ctx.save_for_backward(q4, k4, v4, out, lse)
        ctx.args = args
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q4, k4, v4, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        return (*_backward(ctx.args, q4, k4, v4, out, lse, grad_out, grad_lse), None)


def triton_attention(call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a validated call (4-D view of its inputs)."""
    s = call.shapes
    lead = (1,) * (4 - s.rank)
    q4, k4, v4 = (t.reshape(*lead, *t.shape).contiguous() for t in (call.q, call.k, call.v))
    args = _Args(call, q4, k4, v4)
    if call.backward:
        out, lse = _TritonAttention.apply(q4, k4, v4, args)
    else:
        out, lse = _forward(args, q4, k4, v4)
    return out.reshape(s.out), lse.reshape(s.scores[:-1])


class TritonKernel(Kernel):
    """The block-sparse Triton kernel: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``."""

    name = "triton"
    block_size = (BLOCK_Q, BLOCK_K)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    supports_lse = True
    supports_score_mods = ("bias", "softcap")  # bias: ALiBi only (see _reasons); sinks from the lse
    max_rank = 4

    def runs_on(self, device_type: str) -> bool:
        return AVAILABLE and (device_type == "cuda" or (device_type == "cpu" and interpreted()))

    def _reasons(self, call: Call) -> list[str]:
        reasons = []
        if not AVAILABLE:
            return ["Triton is not installed (pip install 'attnkit[gpu]')"]
        if call.q.device.type != "cuda" and not (interpreted() and call.q.device.type == "cpu"):
            reasons.append(f"runs on CUDA (or on the CPU under TRITON_INTERPRET=1), not {call.q.device.type}")
        if call.compiling:
            reasons.append("prepares its block lists on the host, which torch.compile cannot trace")
        if call.float_mask:
            reasons.append("no additive float mask (pass it as attn_bias=attnkit.bias.dense(...) to another kernel)")
        if call.bias is not None:
            alibi = _alibi(call.bias)
            if alibi is None:
                reasons.append(f"computes ALiBi biases only (with int offsets), not {call.bias.describe()}")
            elif call.softcap is not None:
                reasons.append("soft-capping and ALiBi together (one or the other)")
            elif alibi.slopes.requires_grad and call.backward:
                reasons.append("no gradient for learnable ALiBi slopes")
        if call.q.shape[-1] > 256 or call.v.shape[-1] > 256:
            reasons.append(f"head sizes up to 256, not {call.q.shape[-1]}/{call.v.shape[-1]}")
        return reasons

    def prefers(self, call: Call) -> tuple[bool, Reason]:
        if call.q.device.type != "cuda":
            return False, "Triton's interpreter is for tests on the CPU (kernel='triton' forces it)"
        plain = not call.score_mods() and not call.return_lse and call.dropout_p == 0.0
        if plain and call.mask is None:
            return False, "no mask: PyTorch's flash/cuDNN kernels are faster"
        if plain and call.causal_shift() == 0 and call.scale > 0.0:
            return False, "is_causal: PyTorch's flash/cuDNN kernels are faster"
        kept = call.prepared_at(self.block_size).kept
        return (
            True,
            f"block-sparse on CUDA, {kept:.0%} of blocks kept; the mask is read as data "
            "(no dense mask, no compile per mask)",
        )

    supports_backward_part = True

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, lse = triton_attention(call)
        return out, lse if call.return_lse else None

    def backward_part(
        self, call: Call, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # its backward takes delta = rowsum(grad_out * out) from the output it is given: with the
        # merged output and lse, that is the gradient of this part of the keys
        s = call.shapes
        lead = (1,) * (4 - s.rank)
        q4, k4, v4 = (t.reshape(*lead, *t.shape).contiguous() for t in (call.q, call.k, call.v))
        args = _Args(call, q4, k4, v4)
        return _backward(args, q4, k4, v4, out.to(q4.dtype), lse.float(), grad_out, grad_lse)
