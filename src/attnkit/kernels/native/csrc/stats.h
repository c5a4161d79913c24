// attnkit native engine, stage 6: the statistics of the weights in two passes.
#pragma once

#include "decode.h"

namespace {

// ---- statistics of the weights ----------------------------------------------------------------
//
// attnkit.inspect.attention_stats on the engine, in O(L) memory: per item (sequence, query head,
// row block) and 32 rows at a time, pass 1 walks the listed key blocks with the forward's scores
// and keeps, per row and online (rescaled when the row's maximum grows, as the softmax itself):
// the maximum and its first key, l = sum exp(s - m), T = sum exp(s - m) (s - m) (the entropy is
// log l - T / l), the mass on the first sink_tokens keys and sum exp(s - m) |p(i) - k(j)|. Its
// lse then gives pass 2 the weights exp(s - lse) of the same scores (bit for bit): the mass each
// key receives (summed per thread, then over the threads) and each row's top-k weights. A weight
// below exp(-60) of its row's mass counts as 0 in pass 2 (the PyTorch path's floor); with sinks
// (one logit per head) every weight is relative to the lse that includes the sink.

struct Stats {
    float *lse, *entropy, *max_weight, *sink_mass, *mean_distance, *topk_w;
    int64_t *argmax, *topk_i;
    const float *qpos, *kpos, *sinks;  // positions (Bp, Lq) and (Bk, Lk); sinks (Hq,) or null
    int64_t Bp, Bk, sink_tokens, topk;
};

template <typename T>
struct StatsWork {
    const Problem& pb;
    View<const T> q, k;
    const Stats& st;
    struct State {
        Buffer<> qt, s, kc;
        std::vector<uint8_t> used;
        std::vector<float> received;  // (B, Hq, Lk): this thread's sums
        std::vector<float> tw;        // (topk, SB) the rows' best weights so far, largest first
        std::vector<int32_t> ti;      // (topk, SB) their keys
    };

    void operator()(const Item& it, State& ws) const {
        const int64_t b = it.b, h = it.h, hk = h / pb.group;
        const PlanRow plan = plan_row(pb, b, h, it.qb);
        const int64_t end = pb.key_end(b);
        const float* band = pb.band_of(h);
        const int64_t K = st.topk;
        float* qt = ws.qt.get(pb.D * SB);
        float* s = ws.s.get(pb.bk * SB);
        float* kc = ws.kc.get(pb.bk * pb.D);
        ws.used.resize(pb.bk);
        if (ws.received.empty()) ws.received.assign(pb.B * pb.Hq * pb.Lk, 0.0f);
        ws.tw.resize(SB * std::max<int64_t>(K, 1));
        ws.ti.resize(SB * std::max<int64_t>(K, 1));
        float* recv = ws.received.data() + (b * pb.Hq + h) * pb.Lk;
        const float* qpos = st.qpos + (st.Bp == 1 ? 0 : b) * pb.Lq;
        const float* kpos = st.kpos + (st.Bk == 1 ? 0 : b) * pb.Lk;
        for (int64_t r0 = it.qb * pb.bq; r0 < std::min((it.qb + 1) * pb.bq, pb.Lq); r0 += SB) {
            const int64_t n = std::min<int64_t>(SB, pb.Lq - r0);
            const int64_t row_in_block = r0 - it.qb * pb.bq;
            for (int64_t j = 0; j < SB; ++j) {
                const T* qr = j < n ? q.row(b, h, r0 + j) : nullptr;
                for (int64_t d = 0; d < pb.D; ++d) qt[d * SB + j] = qr ? widen(qr[d]) : 0.0f;
            }
            alignas(64) float pos[SB];
            for (int64_t j = 0; j < SB; ++j) pos[j] = j < n ? qpos[r0 + j] : 0.0f;
            // step t's scores of these rows into s, as the forward computes them (false: nothing to see)
            auto scores = [&](int64_t t, Step& step) {
                return scored_step(pb, plan, t, end, row_in_block, n, ws.used.data(), k, b, hk, kc, qt, band, r0, s, step);
            };
            // pass 1: online per row
            vf m[NVS], l[NVS], tsum[NVS], sink[NVS], dist[NVS], arg[NVS];
            for (int j = 0; j < NVS; ++j)
                m[j] = splat(NEG_INF), l[j] = tsum[j] = sink[j] = dist[j] = vf{}, arg[j] = splat(-1.0f);
            for (int64_t t = 0; t < plan.num; ++t) {
                Step step;
                if (!scores(t, step)) continue;
                for (int j = 0; j < NVS; ++j) {
                    vf mt = splat(NEG_INF), at = splat(-1.0f);
                    for (int64_t c = 0; c < step.kn; ++c) {
                        const vf x = load(s + c * SB + j * W);
                        const vi better = (x > mt) | ((x != x) & (mt == mt));  // the first largest (a NaN: the first NaN)
                        mt = better ? x : mt;
                        at = better ? splat(float(step.k0 + c)) : at;
                    }
                    const vi grew = (mt > m[j]) | ((mt != mt) & (m[j] == m[j]));
                    const vf mn = grew ? mt : m[j];
                    arg[j] = grew ? at : arg[j];
                    const vf ms = mn == splat(NEG_INF) ? vf{} : mn;
                    const vf alpha = vexp(m[j] - ms);  // 0 while m is -inf, NaN once it is NaN
                    // T relative to the new maximum: alpha (T + (m_old - m_new) l); 0 while l is 0
                    const vf shift = l[j] == vf{} ? vf{} : (m[j] - ms) * l[j];
                    tsum[j] = alpha * (tsum[j] + shift);
                    l[j] *= alpha, sink[j] *= alpha, dist[j] *= alpha;
                    const vf p = load(pos + j * W);
                    for (int64_t c = 0; c < step.kn; ++c) {
                        const vf x = load(s + c * SB + j * W) - ms;
                        const vf e = vexp(x);
                        l[j] += e;
                        tsum[j] += e > vf{} ? e * x : vf{};  // a hidden pair (-inf): exactly 0
                        if (step.k0 + c < st.sink_tokens) sink[j] += e;
                        const vf dd = p - splat(kpos[step.k0 + c]);
                        dist[j] += e * (dd < vf{} ? -dd : dd);
                    }
                    m[j] = mn;
                }
            }
            // the rows' results; lse with the sink
            // pass 2's weight of a score s is exp(s - m) * share: exp of a difference that is exact
            // for the largest scores, times the row's keys' share over l (a float32 lse near 80 is
            // rounded by up to 4e-6, which exp(s - lse) would pass on to every weight of the row)
            alignas(64) float lse_row[SB], max_row[SB], share_row[SB];
            for (int64_t j = 0; j < SB; ++j) {
                const int64_t lane = j % W, v = j / W;
                const float lj = l[v][lane], mj = m[v][lane];
                const float lk = lj > 0.0f ? mj + std::log(lj) : (lj == 0.0f ? NEG_INF : NaN);
                float lse = lk;
                if (st.sinks) {
                    const float a = st.sinks[h];
                    const float hi = std::max(lk, a);
                    lse = hi == NEG_INF ? NEG_INF : hi + std::log(std::exp(lk - hi) + std::exp(a - hi));
                    if (lk != lk) lse = NaN;
                }
                // padding rows and rows that see no key (lse -inf, every score -inf: -inf - -inf would be NaN): no weight
                lse_row[j] = j < n && lse != NEG_INF ? lse : std::numeric_limits<float>::infinity();
                max_row[j] = mj == NEG_INF ? 0.0f : mj;  // (no finite score: every weight is 0 below)
                share_row[j] = 0.0f;
                if (j >= n) continue;
                const int64_t at = (b * pb.Hq + h) * pb.Lq + r0 + j;
                // the keys' share of the row's mass, l / (l + exp(sink - m)) with a sink: exp(lk - lse)
                // would carry both lse's roundings (4e-6 each near 80)
                const float r = lj > 0.0f ? (st.sinks ? lj / (lj + std::exp(st.sinks[h] - mj)) : 1.0f)
                                          : (lj == 0.0f ? 0.0f : NaN);
                const float inv = lj > 0.0f ? 1.0f / lj : (lj == 0.0f ? 0.0f : NaN);
                share_row[j] = r * inv;
                st.lse[at] = lse;
                const float h_keys = lj > 0.0f ? std::log(lj) - tsum[v][lane] * inv : (lj == 0.0f ? 0.0f : NaN);
                st.entropy[at] = r > 0.0f ? r * h_keys - r * std::log(r) : (r == 0.0f ? 0.0f : NaN);
                st.max_weight[at] = r * inv;
                st.argmax[at] = lj > 0.0f ? int64_t(arg[v][lane]) : -1;
                st.sink_mass[at] = r * sink[v][lane] * inv;
                st.mean_distance[at] = r * dist[v][lane] * inv;
            }
            // pass 2: the weights exp(s - lse): the mass each key receives, the rows' top k
            // the top k in vector layout: slot a of rows j..j+W-1 is one vector, so a column whose
            // weights all fall short of the rows' k-th best costs one compare, and an insertion is
            // K compare-and-swaps of whole vectors (no branch per row)
            float* tw = ws.tw.data();
            int32_t* ti = ws.ti.data();
            if (K) std::fill_n(tw, SB * K, 0.0f), std::fill_n(ti, SB * K, int32_t(-1));
            for (int64_t t = 0; t < plan.num; ++t) {
                Step step;
                if (!scores(t, step)) continue;
                for (int64_t c = 0; c < step.kn; ++c) {
                    vf col{};
                    for (int j = 0; j < NVS; ++j) {
                        const vf x = load(s + c * SB + j * W);
                        const vf d = x - load(lse_row + j * W);
                        const vf e = vexp(x - load(max_row + j * W)) * load(share_row + j * W);
                        const vf w = d > splat(EXP_FLOOR) ? e : vf{};  // below exp(-60): 0 (NaN stays NaN)
                        const vf wn = d != d ? d : w;
                        col += wn;
                        if (K && any(wn > load(tw + (K - 1) * SB + j * W))) {
                            vf x = wn;  // insert, largest first: strictly larger moves down (a tie
                            vi xi = vi{} + int32_t(step.k0 + c);  // keeps the earlier key first; NaN never enters)
                            for (int64_t a = 0; a < K; ++a) {
                                float* pw = tw + a * SB + j * W;
                                int32_t* pi = ti + a * SB + j * W;
                                const vf cw = load(pw);
                                vi ci;
                                std::memcpy(&ci, pi, sizeof(vi));
                                const vi take = x > cw;
                                store(pw, take ? x : cw);
                                const vi ni = take ? xi : ci;
                                std::memcpy(pi, &ni, sizeof(vi));
                                x = take ? cw : x;
                                xi = take ? ci : xi;
                            }
                        }
                    }
                    recv[step.k0 + c] += hsum(col);
                }
            }
            for (int64_t j = 0; j < n && K; ++j) {
                const int64_t at = ((b * pb.Hq + h) * pb.Lq + r0 + j) * K;
                for (int64_t a = 0; a < K; ++a) st.topk_w[at + a] = tw[a * SB + j], st.topk_i[at + a] = ti[a * SB + j];
            }
        }
    }
};

}  // namespace
