// attnkit native engine, stage 7: the backward pass.
#pragma once

#include "bf16.h"
#include "decode.h"

namespace {

// ---- backward -----------------------------------------------------------------------------
//
// One item is a K/V head of one sequence and a chunk of its row blocks, for every query head of
// its group: dK and dV are summed in the item's own float32 buffer (no two threads write one),
// dQ of each row is complete at the end of its step loop and written once.
//
// P is recomputed as exp(S - lse) and renormalised over the row's keys: the float32 lse carries
// a rounding of |lse| x 6e-8 into every weight alike, and with delta = sum of P dP (the softmax's
// own backward) a common error e of P turns into an error e * P * delta of every dS, which grows
// with |lse| (measured 5-10x the naive formula's dQ/dK error on sharp rows before the fix).

template <typename T>
struct Backward {
    const Problem& pb;
    View<const T> q, k, v, grad_out, fwd_out;
    const float* lse;
    const float* grad_lse;
    T* dq;  // (B, Hq, Lq, D) contiguous
    float* dk_acc;  // (B, Hkv, chunks, nk * bk, Dp)
    float* dv_acc;  // (B, Hkv, chunks, nk * bk, Dvp)
    StepGrads<T> products;
    struct State {
        Buffer<> qt, qr, qc, dot, dor, ot, dqt, kc, vc, ps, dps, ts;
        std::vector<uint8_t> used;
        std::vector<Step> steps;
        std::vector<float> gband;  // the band's gradient, reversed like band_rev (band_grad only)
        typename StepScores<T>::State scores;  // the forward's products, recomputed (bf16.h for bfloat16)
        typename StepGrads<T>::State grads;
    };

    void operator()(const Item& it, State& st) const {
        const int64_t b = it.b, hk = it.h;
        const int64_t kv_rows = pb.nk * pb.bk;
        float* dk = dk_acc + ((b * pb.Hkv + hk) * pb.chunks + it.qb) * kv_rows * pb.Dp;
        float* dv = dv_acc + ((b * pb.Hkv + hk) * pb.chunks + it.qb) * kv_rows * pb.Dvp;
        st.used.resize(pb.bk);
        if (pb.band_grad && st.gband.empty()) st.gband.assign(pb.band_heads * (pb.Lq + pb.Lk - 1 + SB), 0.0f);
        const int64_t end = pb.key_end(b);
        const int64_t qb0 = it.qb * pb.nq / pb.chunks, qb1 = (it.qb + 1) * pb.nq / pb.chunks;
        for (int64_t h = hk * pb.group; h < (hk + 1) * pb.group; ++h) {
            const float* band = pb.band_of(h);
            for (int64_t qb = qb0; qb < qb1; ++qb) {
                const PlanRow plan = plan_row(pb, b, h, qb);
                if (plan.num == 0) {  // these queries see no key: their gradient is 0
                    const int64_t q0 = qb * pb.bq, q1 = std::min((qb + 1) * pb.bq, pb.Lq);
                    std::fill_n(dq + ((b * pb.Hq + h) * pb.Lq + q0) * pb.D, (q1 - q0) * pb.D, narrow<T>(0.0f));
                    continue;
                }
                for (int64_t r0 = qb * pb.bq; r0 < std::min((qb + 1) * pb.bq, pb.Lq); r0 += SB)
                    step_rows(st, b, h, hk, qb, r0, plan, end, band, dk, dv);
            }
        }
    }

    // S^T (kn x SB) of a call of at most FEW_ROWS queries as its forward computed it (row_dots):
    // query rows qr (Dp apart, zero-padded), keys no row of the step uses as zero rows; buf has
    // room for W + 1 rows of Dp (the padded keys and a zero row).
    void few_scores(const Step& step, int64_t b, int64_t hk, const uint8_t* used, const float* qr, int64_t n,
                    float* buf, float* s) const {
        const int64_t Dp = pb.Dp;
        float* zero = buf + W * Dp;
        std::fill_n(zero, Dp, 0.0f);
        for (int64_t c0 = 0; c0 < step.kn; c0 += W) {
            const float* kr[W];
            for (int64_t c = 0; c < W; ++c) {
                const int64_t key = c0 + c;
                const bool read = key < step.kn && (used == nullptr || used[key]);
                kr[c] = read ? padded_row(k.row(b, hk, step.k0 + key), pb.D, Dp, buf + c * Dp) : zero;
            }
            const int64_t cn = std::min<int64_t>(W, step.kn - c0);
            for (int64_t j = 0; j < SB; ++j) {
                if (j < n) {
                    const vf sums = row_dots(kr, qr + j * Dp, Dp);
                    for (int64_t c = 0; c < cn; ++c) s[(c0 + c) * SB + j] = sums[c];
                } else {
                    for (int64_t c = 0; c < cn; ++c) s[(c0 + c) * SB + j] = 0.0f;
                }
            }
        }
    }

    void step_rows(State& st, int64_t b, int64_t h, int64_t hk, int64_t qb, int64_t r0, const PlanRow& plan,
                   int64_t end, const float* band, float* dk, float* dv) const {
        const int64_t Dp = pb.Dp, Dvp = pb.Dvp, D = pb.D, Dv = pb.Dv;
        const int64_t n = std::min<int64_t>(SB, pb.Lq - r0);
        const int64_t row_in_block = r0 - qb * pb.bq;
        const int64_t Dpair = (D + 1) / 2;
        float* qt = st.qt.get(2 * Dpair * SB);  // Q^T (for the scores), rows past D zero
        float* qr = st.qr.get(SB * Dp);    // Q rows (for dK)
        float* qc = st.qc.get(SB * Dp);    // the same, rows that see no key of a step zeroed
        const int64_t Dvpair = (Dv + 1) / 2;
        float* dot = st.dot.get(2 * Dvpair * SB);  // dO^T (for dP^T), rows past Dv zero
        float* dor = st.dor.get(SB * Dvp); // dO rows (for dV)
        float* dqt = st.dqt.get(D * SB);   // dQ^T
        float* ot = st.ot.get(Dv * SB);    // the forward's O^T (for delta of a part of the keys)
        float* kc = st.kc.get(std::max(pb.bk * D, (W + 1) * Dp));  // (few_scores: W key rows and a zero row)
        float* vc = st.vc.get(pb.bk * Dv);
        alignas(64) float shift[SB], delta[SB], gl[SB];
        std::fill_n(qt + D * SB, (2 * Dpair - D) * SB, 0.0f);
        std::fill_n(dot + Dv * SB, (2 * Dvpair - Dv) * SB, 0.0f);
        for (int64_t j = 0; j < SB; ++j) {
            const bool in = j < n;
            const T* qj = in ? q.row(b, h, r0 + j) : nullptr;
            const T* gj = in ? grad_out.row(b, h, r0 + j) : nullptr;
            for (int64_t d = 0; d < D; ++d) {
                const float x = in ? widen(qj[d]) : 0.0f;
                qt[d * SB + j] = x;
                qr[j * Dp + d] = x;
            }
            for (int64_t d = D; d < Dp; ++d) qr[j * Dp + d] = 0.0f;
            for (int64_t d = 0; d < Dv; ++d) {
                const float g = in ? widen(gj[d]) : 0.0f;
                dot[d * SB + j] = g;
                dor[j * Dvp + d] = g;
            }
            for (int64_t d = Dv; d < Dvp; ++d) dor[j * Dvp + d] = 0.0f;
            if (pb.delta_from_out) {
                const T* oj = in ? fwd_out.row(b, h, r0 + j) : nullptr;
                for (int64_t d = 0; d < Dv; ++d) ot[d * SB + j] = in ? widen(oj[d]) : 0.0f;
            }
            const int64_t at = (b * pb.Hq + h) * pb.Lq + r0 + j;
            const float x = in ? lse[at] : NEG_INF;
            shift[j] = x == NEG_INF ? 0.0f : x;  // such a row sees no key: its scores are all -inf
            gl[j] = in && grad_lse ? grad_lse[at] : 0.0f;
        }
        const StepScores<T> recompute{};
        recompute.begin(st.scores, pb, qt);
        products.begin(st.grads, pb, qr, dor, dot);
        // Pass 1: every step's P^T = exp(S^T - lse) (0 where hidden) and dP^T = V dO^T, kept in this
        // thread's row buffers (O(keys of the row) floats), with the row sums of P and of P dP.
        const int64_t tile = pb.bk * SB;
        float* ps = st.ps.get(plan.num * tile);
        float* dps = st.dps.get(plan.num * tile);
        float* ts = pb.softcap > 0.0f ? st.ts.get(plan.num * tile) : nullptr;  // tanh of the scores
        st.steps.assign(plan.num, Step{0, 0, nullptr, false, true, 0});
        vf sum_p[NVS], sum_pdp[NVS];
        for (int j = 0; j < NVS; ++j) sum_p[j] = sum_pdp[j] = vf{};
        for (int64_t i = 0; i < plan.num; ++i) {
            Step step;
            if (!open_step(pb, plan, i, end, row_in_block, n, st.used.data(), step)) continue;
            const uint8_t* used = step.all_used ? nullptr : st.used.data();
            float* si = ps + i * tile;
            float* dpi = dps + i * tile;
            if (pb.Lq <= FEW_ROWS)  // the row path's scores (its forward ran on these calls)
                few_scores(step, b, hk, used, qr, n, kc, si);
            else
                recompute(st.scores, pb, step, k.row(b, hk, step.k0), k.s2, used, qt, kc, si);
            modify_scores(pb, step, si, ts ? ts + i * tile : nullptr, band, r0);
            products.dp(st.grads, pb, step, v.row(b, hk, step.k0), v.s2, vc, dot, dpi);  // dP^T (kn x SB)
            vf part_p[NVS], part_pdp[NVS];  // this step's sums from zero, then added: sums of per-step sums
            for (int j = 0; j < NVS; ++j) part_p[j] = part_pdp[j] = vf{};
            for (int64_t c = 0; c < step.kn; ++c)
                for (int j = 0; j < NVS; ++j) {
                    const vf x = load(si + c * SB + j * W);
                    const vi hidden = x == splat(NEG_INF);
                    vf p = vexp(x - load(shift + j * W));
                    p = hidden ? vf{} : p;  // hidden: exactly 0, even where the lse is NaN
                    store(si + c * SB + j * W, p);
                    part_p[j] += p;
                    const vf pdp = p * load(dpi + c * SB + j * W);
                    part_pdp[j] += hidden ? vf{} : pdp;  // (its dP may be NaN: V is read as it is)
                }
            for (int j = 0; j < NVS; ++j) sum_p[j] += part_p[j], sum_pdp[j] += part_pdp[j];
            st.steps[i] = step;
        }
        // The row's own keys: P / sum(P), delta = sum(P dP) / sum(P). A part of the keys (ring
        // attention) has the merged output and lse: P as it is, delta = rowsum(dO O).
        vf norm[NVS];
        for (int j = 0; j < NVS; ++j) {
            vf d;
            if (pb.delta_from_out) {
                norm[j] = splat(1.0f);
                d = vf{};
                for (int64_t x = 0; x < Dv; ++x) d += load(ot + x * SB + j * W) * load(dot + x * SB + j * W);
            } else {
                const vf l = sum_p[j];
                norm[j] = l > vf{} ? splat(1.0f) / l : (l == vf{} ? vf{} : splat(NaN));
                d = sum_pdp[j] * norm[j];
            }
            store(delta + j * W, d - load(gl + j * W));
        }
        // Pass 2: dS^T = P^T (dP^T - delta) (the band's gradient), through the tanh, times the scale; dV, dK and dQ
        std::fill_n(dqt, D * SB, 0.0f);
        float* gband = pb.band_grad ? st.gband.data() + (pb.band_heads == 1 ? 0 : h) * (pb.Lq + pb.Lk - 1 + SB) : nullptr;
        const vf scale = splat(pb.scale);
        for (int64_t i = 0; i < plan.num; ++i) {
            const Step& step = st.steps[i];
            if (step.kn == 0) continue;
            const uint8_t* used = nullptr;
            if (!step.all_used) {  // K rows no query of the step uses: zeroed (dQ reads them)
                scan(pb, step.bits, step.kn, n, st.used.data());
                used = st.used.data();
            }
            float* pi = ps + i * tile;
            float* dsi = dps + i * tile;
            const float* ti = ts ? ts + i * tile : nullptr;
            // a hidden pair has P = 0 and no gradient whatever the row holds (its lse or delta may be
            // NaN); a visible pair of a NaN row is NaN, even where its own score is -inf (as the formula's).
            // dS then goes through the softcap's tanh and times the scale, in the same pass; a learned
            // band sums its gradient (dS before those) in a pass between the two
            for (int64_t c = 0; c < step.kn; ++c) {
                const uint32_t w = step.masked ? mask_word(step.bits + c * (pb.bq / 8)) : ~0u;
                for (int j = 0; j < SB; j += W) {
                    const int64_t at = c * SB + j;
                    const vi shown = kept(w, j);
                    const vf p = shown ? load(pi + at) * norm[j / W] : vf{};
                    store(pi + at, p);
                    vf ds = p * (load(dsi + at) - load(delta + j));
                    if (gband) {
                        store(dsi + at, shown ? ds : vf{});
                        continue;
                    }
                    if (ti) {
                        const vf th = load(ti + at);
                        ds = ds * (splat(1.0f) - th * th);
                    }
                    store(dsi + at, shown ? ds * scale : vf{});  // (a hidden pair's tanh may be NaN)
                }
            }
            if (gband) {  // d loss / d bias(kv - q) = dS, summed along the tile's diagonals
                for (int64_t c = 0; c < step.kn; ++c) {
                    float* g = gband + (pb.Lk - 1 - step.k0 - c + r0);
                    for (int j = 0; j < SB; j += W) store(g + j, load(g + j) + load(dsi + c * SB + j));
                }
                for (int64_t c = 0; c < step.kn; ++c)
                    for (int j = 0; j < SB; j += W) {
                        const int64_t at = c * SB + j;
                        vf ds = load(dsi + at);
                        if (ti) {  // a hidden pair's dS stays 0 (its tanh is NaN where its row or key is)
                            const vf th = load(ti + at);
                            ds = ds == vf{} ? ds : ds * (splat(1.0f) - th * th);
                        }
                        store(dsi + at, ds * scale);
                    }
            }
            products.grads(st.grads, pb, step, b, hk, k.row(b, hk, step.k0), k.s2, used, n, kc, qr, qc, dor, pi, dsi, dv,
                           dk, dqt);
        }
        for (int64_t j = 0; j < n; ++j) {
            T* dst = dq + ((b * pb.Hq + h) * pb.Lq + r0 + j) * D;
            column_as_row(dqt, D, j, 1.0f, dst);
        }
    }
};

}  // namespace
