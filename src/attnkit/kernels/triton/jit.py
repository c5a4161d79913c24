"""The Triton programs of the ``triton`` kernel (:mod:`attnkit.kernels.triton_attention`): the
scores of one tile with its mask and modifications, and the forward and backward programs of
one query block. Defined only where Triton is installed (the "gpu" extra).
"""

from __future__ import annotations

from attnkit.kernels.triton.env import AVAILABLE, tl, triton

__all__ = ["AVAILABLE", "backward_kernel", "forward_kernel"]

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
    def forward_kernel(
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
    def backward_kernel(
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
