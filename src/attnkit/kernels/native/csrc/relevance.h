// attnkit native engine, stage 7: the gradient rule's reduction of the weights.
#pragma once

#include "stats.h"

namespace {

// ---- relevance: sum_i r[b, :, i] sum_h w_h max(0, dA A), or sum_i r[b, :, i] sum_h w_h A ----------
//
// attnkit.inspect.rollout(method="grad") on the engine, in O(L) memory: per item (sequence, query
// head, row block) and 32 rows at a time (skipped where the head's weight or every row's r is 0),
// each listed key block's scores as the forward computes them, its weights A = exp(s - lse) with
// the forward's lse (a weight below exp(-60) of its row's mass is 0, as in the statistics), the
// gradient of the weights dA = dO V^T (V's rows against dO^T: one more product of the scores'
// shape), and out[b, a, key] += w_h sum_i r[b, a, i] max(0, dA A) summed per thread, then over the
// threads. Without dO, the weights alone: out += w_h sum_i r[b, a, i] A (rollout's r @ A).
//
// The forward's lse is a float32: a rounding of up to half an ulp of |lse| (4e-6 at lse = 80), the
// same for every weight of its row, which exp(s - lse) turns into a relative error of the whole
// row (an eager softmax, exp(s - max) / sum, has none on its largest weight). A first pass over
// the row's steps sums its weights (and the sink's exp(sink - lse)); each row's r is divided by
// that sum, which is 1 but for that rounding: the weights then sum to 1 as the softmax's do.

struct Relevance {
    const float* lse;     // (B, Hq, Lq): the forward's, with the sinks' mass
    const float* d_out;   // (B, Hq, Lq, Dv), or null: the weights alone (r @ A, rollout)
    const float* r;       // (B, R, Lq)
    const float* head_w;  // (Hq,)
    const float* sinks;   // (Hq,): each head's sink logit, or null
    int64_t R;
};

template <typename T>
struct RelevanceWork {
    const Problem& pb;
    View<const T> q, k, v;
    const Relevance& rl;
    struct State {
        Buffer<> qt, dt, s, da, kc, vc, rv;
        std::vector<uint8_t> used;
        std::vector<float> out;  // (B, R, Lk): this thread's sums
    };

    void operator()(const Item& it, State& ws) const {
        const int64_t b = it.b, h = it.h, hk = h / pb.group, R = rl.R;
        const float hw = rl.head_w[h];
        if (hw == 0.0f) return;
        const PlanRow plan = plan_row(pb, b, h, it.qb);
        const int64_t end = pb.key_end(b);
        const float* band = pb.band_of(h);
        float* qt = ws.qt.get(pb.D * SB);
        float* dt = ws.dt.get(pb.Dv * SB);
        float* s = ws.s.get(pb.bk * SB);
        float* da = ws.da.get(pb.bk * SB);
        float* kc = ws.kc.get(pb.bk * pb.D);
        float* vc = ws.vc.get(pb.bk * pb.Dv);
        float* rv = ws.rv.get(R * SB);
        ws.used.resize(pb.bk);
        if (ws.out.empty()) ws.out.assign(pb.B * R * pb.Lk, 0.0f);
        for (int64_t r0 = it.qb * pb.bq; r0 < std::min((it.qb + 1) * pb.bq, pb.Lq); r0 += SB) {
            const int64_t n = std::min<int64_t>(SB, pb.Lq - r0);
            bool weighted = false;
            for (int64_t a = 0; a < R; ++a)
                for (int64_t j = 0; j < SB; ++j) {
                    const float x = j < n ? rl.r[(b * R + a) * pb.Lq + r0 + j] * hw : 0.0f;
                    rv[a * SB + j] = x;
                    weighted |= x != 0.0f;
                }
            if (!weighted) continue;
            for (int64_t j = 0; j < SB; ++j) {
                const T* qr = j < n ? q.row(b, h, r0 + j) : nullptr;
                for (int64_t d = 0; d < pb.D; ++d) qt[d * SB + j] = qr ? widen(qr[d]) : 0.0f;
                if (!rl.d_out) continue;
                const float* dr = j < n ? rl.d_out + ((b * pb.Hq + h) * pb.Lq + r0 + j) * pb.Dv : nullptr;
                for (int64_t d = 0; d < pb.Dv; ++d) dt[d * SB + j] = dr ? dr[d] : 0.0f;
            }
            alignas(64) float lse_row[SB];
            for (int64_t j = 0; j < SB; ++j) {  // a padding row, or one that sees no key: no weight
                const float l = j < n ? rl.lse[(b * pb.Hq + h) * pb.Lq + r0 + j] : NEG_INF;
                lse_row[j] = std::isfinite(l) ? l : std::numeric_limits<float>::infinity();
            }
            const int64_t row_in_block = r0 - it.qb * pb.bq;
            // step t's scores of these rows into s, as the forward computes them (false: nothing to see)
            auto scores_at = [&](int64_t t, Step& step) {
                return scored_step(pb, plan, t, end, row_in_block, n, ws.used.data(), k, b, hk, kc, qt, band, r0, s, step);
            };
            // pass 1: each row's sum of its weights (1 but for the lse's rounding), r divided by it
            alignas(64) float total[SB];
            {
                vf sum[NVS];
                for (int j = 0; j < NVS; ++j) sum[j] = vf{};
                for (int64_t t = 0; t < plan.num; ++t) {
                    Step step;
                    if (!scores_at(t, step)) continue;
                    for (int64_t c = 0; c < step.kn; ++c)
                        for (int j = 0; j < NVS; ++j) {
                            const vf d = load(s + c * SB + j * W) - load(lse_row + j * W);
                            sum[j] += d > splat(EXP_FLOOR) ? vexp(d) : vf{};
                        }
                }
                for (int j = 0; j < NVS; ++j) store(total + j * W, sum[j]);
            }
            for (int64_t j = 0; j < SB; ++j) {
                const float mass = total[j] + (rl.sinks && std::isfinite(lse_row[j]) ? std::exp(rl.sinks[h] - lse_row[j]) : 0.0f);
                const float scale = mass > 0.0f ? 1.0f / mass : 0.0f;
                for (int64_t a = 0; a < R; ++a) rv[a * SB + j] *= scale;
            }
            float* out = ws.out.data() + b * R * pb.Lk;
            for (int64_t t = 0; t < plan.num; ++t) {
                Step step;
                if (!scores_at(t, step)) continue;
                const uint8_t* used = step.all_used ? nullptr : ws.used.data();
                int64_t vstride;
                if (rl.d_out) {  // dA^T (kn x SB) = V (kn x Dv) dO^T (Dv x SB)
                    const float* vrows = rows_f32(v.row(b, hk, step.k0), v.s2, step.kn, pb.Dv, used, vc, pb.Dv, vstride);
                    gemm<false>(step.kn, SB, pb.Dv, vrows, vstride, 1, dt, SB, da, SB);
                }
                for (int64_t c = 0; c < step.kn; ++c) {
                    vf m[NVS];
                    for (int j = 0; j < NVS; ++j) {
                        const vf d = load(s + c * SB + j * W) - load(lse_row + j * W);
                        const vf w = d > splat(EXP_FLOOR) ? vexp(d) : vf{};  // hidden (-inf) and padding: 0
                        if (!rl.d_out) {
                            m[j] = w;
                            continue;
                        }
                        const vf x = load(da + c * SB + j * W) * w;
                        m[j] = x > vf{} ? x : vf{};
                    }
                    for (int64_t a = 0; a < R; ++a) {
                        vf acc{};
                        for (int j = 0; j < NVS; ++j) acc += load(rv + a * SB + j * W) * m[j];
                        out[a * pb.Lk + step.k0 + c] += hsum(acc);
                    }
                }
            }
        }
    }
};

}  // namespace
