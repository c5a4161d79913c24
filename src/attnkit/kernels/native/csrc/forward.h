// attnkit native engine, stage 4: the forward pass (online softmax over key-major tiles of 32 rows).
#pragma once

#include "plan.h"

namespace {

// ---- forward ------------------------------------------------------------------------------

// The row statistics of the online softmax across SB rows, NaN-aware: a NaN score a row sees
// makes its max, sum, output and lse NaN (the formula's), a row with no finite score keeps
// m = -inf and l = 0.
struct Online {
    vf m[NVS], l[NVS];
    Online() {
        for (int j = 0; j < NVS; ++j) m[j] = splat(NEG_INF), l[j] = vf{};
    }
    // Turns S^T (kn x SB) into P^T = exp(S^T - m) in place; rescales ot (rows x SB) when the max grew.
    void step(float* s, int64_t kn, float* ot, int64_t rows) {
        vf mt[NVS], ms[NVS], alpha[NVS], sum[NVS];
        for (int j = 0; j < NVS; ++j) mt[j] = splat(NEG_INF), sum[j] = vf{};
        for (int64_t c = 0; c < kn; ++c)
            for (int j = 0; j < NVS; ++j) mt[j] = vmax_nan(mt[j], load(s + c * SB + j * W));
        bool rescale = false;
        for (int j = 0; j < NVS; ++j) {
            const vf mn = vmax_nan(m[j], mt[j]);
            ms[j] = mn == splat(NEG_INF) ? vf{} : mn;
            alpha[j] = vexp(m[j] - ms[j]);  // 0 while m is -inf, NaN once it is NaN
            rescale |= any(mt[j] > m[j]);
            m[j] = mn;
        }
        for (int64_t c = 0; c < kn; ++c)
            for (int j = 0; j < NVS; ++j) {
                vf p = vexp(load(s + c * SB + j * W) - ms[j]);
                sum[j] += p;
                store(s + c * SB + j * W, p);
            }
        for (int j = 0; j < NVS; ++j) l[j] = l[j] * alpha[j] + sum[j];
        if (rescale)
            for (int64_t d = 0; d < rows; ++d)
                for (int j = 0; j < NVS; ++j) store(ot + d * SB + j * W, load(ot + d * SB + j * W) * alpha[j]);
    }
    float lse(int64_t j) const {
        const float lj = l[j / W][j % W], mj = m[j / W][j % W];
        if (lj > 0.0f) return mj + std::log(lj);
        return lj == 0.0f ? NEG_INF : NaN;
    }
    float inverse(int64_t j) const {
        const float lj = l[j / W][j % W];
        if (lj > 0.0f) return 1.0f / lj;
        return lj == 0.0f ? 0.0f : NaN;
    }
};

template <typename T>
struct Forward {
    const Problem& pb;
    View<const T> q, k, v;
    View<T> out;
    float* lse;
    struct State {
        Buffer<> qt, s, o, kc, vc;
        std::vector<uint8_t> used;
    };

    void operator()(const Item& it, State& st) const {
        const int64_t b = it.b, h = it.h, hk = h / pb.group;
        const PlanRow plan = plan_row(pb, b, h, it.qb);
        const int64_t end = pb.key_end(b);
        const int64_t Dvp = round_up(pb.Dv, W);
        const float* band = pb.band_of(h);
        float* qt = st.qt.get(pb.D * SB);
        float* s = st.s.get(pb.bk * SB);
        float* ot = st.o.get(pb.Dv * SB);
        float* kc = st.kc.get(pb.bk * pb.D);
        float* vc = st.vc.get(pb.bk * Dvp);
        st.used.resize(pb.bk);
        for (int64_t r0 = it.qb * pb.bq; r0 < std::min((it.qb + 1) * pb.bq, pb.Lq); r0 += SB) {
            const int64_t n = std::min<int64_t>(SB, pb.Lq - r0);
            const int64_t row_in_block = r0 - it.qb * pb.bq;
            // Q^T (D x SB); rows past Lq are 0
            for (int64_t j = 0; j < SB; ++j) {
                const T* qr = j < n ? q.row(b, h, r0 + j) : nullptr;
                for (int64_t d = 0; d < pb.D; ++d) qt[d * SB + j] = qr ? widen(qr[d]) : 0.0f;
            }
            std::fill_n(ot, pb.Dv * SB, 0.0f);
            Online soft;
            for (int64_t t = 0; t < plan.num; ++t) {
                Step step;
                if (!open_step(pb, plan, t, end, row_in_block, n, st.used.data(), step)) continue;
                const uint8_t* used = step.all_used ? nullptr : st.used.data();
                int64_t kstride, vstride;
                const float* krows = rows_f32(k.row(b, hk, step.k0), k.s2, step.kn, pb.D, used, kc, pb.D, kstride);
                const float* vrows = rows_f32(v.row(b, hk, step.k0), v.s2, step.kn, pb.Dv, used, vc, Dvp, vstride);
                scores_f32(pb, step, krows, kstride, qt, s);
                modify_scores(pb, step, s, nullptr, band, r0);
                soft.step(s, step.kn, ot, pb.Dv);
                // O^T (Dv x SB) += V^T (Dv x kn) P^T (kn x SB)
                gemm<true>(pb.Dv, SB, step.kn, vrows, 1, vstride, s, SB, ot, SB);
            }
            finish(soft, ot, b, h, r0, n);
        }
        if (streams()) stream_fence();
    }

    // Output rows of float32 written past the caches: rows aligned to 64 bytes, whole vectors, and
    // an output of 8 MiB or more (one that a core's cache would not keep for its reader anyway).
    bool streams() const {
        if constexpr (!std::is_same_v<T, float>) return false;
        return pb.Dv % W == 0 && out.s0 % 16 == 0 && out.s1 % 16 == 0 && out.s2 % 16 == 0 &&
               reinterpret_cast<uintptr_t>(out.p) % 64 == 0 &&
               pb.B * pb.Hq * pb.Lq * pb.Dv >= (int64_t(1) << 21);
    }

    void finish(const Online& soft, const float* ot, int64_t b, int64_t h, int64_t r0, int64_t n) const {
        float* l = lse + (b * pb.Hq + h) * pb.Lq + r0;
        const bool stream = streams();
        for (int64_t j = 0; j < n; ++j) {
            l[j] = soft.lse(j);
            const float inv = soft.inverse(j);
            column_as_row(ot, pb.Dv, j, inv, out.row(b, h, r0 + j), stream);
        }
    }
};

}  // namespace
