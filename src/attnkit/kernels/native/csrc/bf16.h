// attnkit native engine: the bfloat16 path on the CPU's bfloat16 products (AVX512-BF16 dot
// products, AMX tiles): Q K^T against Q^T packed pair-major, P V from P^T packed pair-major, the
// statistics as the float32 forward; and the backward's scores recomputed with the same products.
// Where the build has no bfloat16 products, bfloat16 runs on the float32 code (tiles widened) and
// this file declares only what says so.
#pragma once

#include "forward.h"

namespace {

#if ATTNKIT_BF16_DOT
// Q K^T of one step in bfloat16 dot products: K rows as bfloat16 (adjacent dims in pairs) times
// Q^T packed pair-major (D/2, SB, 2). Shared by the forward and the backward (bit for bit).
__attribute__((noinline)) void scores_bf16(const Step& st, int64_t dpairs, const c10::BFloat16* krows,
                                           int64_t kstride, const c10::BFloat16* q2, float* s) {
    gemm_bf16<false>(st.kn, dpairs, krows, kstride, q2, s, SB);
}

// K rows [k0, k0 + kn) as bfloat16 rows of an even width: in place when every key is used and D
// is even, else copied into dst (rows no query of the step uses, and the padding dim, zeroed).
const c10::BFloat16* bf16_rows(const c10::BFloat16* src, int64_t stride, int64_t kn, int64_t width,
                               const uint8_t* used, c10::BFloat16* dst, int64_t& out_stride) {
    if (used == nullptr && width % 2 == 0) {
        out_stride = stride;
        return src;
    }
    const int64_t ld = round_up(width, 2);
    for (int64_t c = 0; c < kn; ++c) {
        c10::BFloat16* d = dst + c * ld;
        if (used == nullptr || used[c]) {
            std::memcpy(d, src + c * stride, width * sizeof(c10::BFloat16));
            if (width < ld) d[width] = c10::BFloat16(0.0f);
        } else {
            std::memset(d, 0, ld * sizeof(c10::BFloat16));  // +0.0 in bfloat16
        }
    }
    out_stride = ld;
    return dst;
}

// Q^T (rows x SB float32, rows >= D zero) as pair-major bfloat16 (rows / 2, SB, 2).
void pack_columns(const float* qt, int64_t pairs, c10::BFloat16* q2) {
    for (int64_t p = 0; p < pairs; ++p) pack_pair(qt + 2 * p * SB, qt + (2 * p + 1) * SB, q2 + p * 2 * SB);
}

// step() for the bfloat16 products: S^T (kn x SB) times mul (the scale, when the scores are
// not yet scaled; mul > 0), its weights written as P^T pair-major bfloat16 (kn/2 pairs, an odd
// kn padded with a zero row) in the same pass, S left as it was.
inline void step_packed(Online& on, const float* s, int64_t kn, float mul, float* ot, int64_t rows, c10::BFloat16* p2) {
vf* m = on.m;
vf* l = on.l;
    vf mt[NVS], ms[NVS], alpha[NVS], sum[NVS];
    for (int j = 0; j < NVS; ++j) mt[j] = splat(NEG_INF), sum[j] = vf{};
    for (int64_t c = 0; c < kn; ++c)
        for (int j = 0; j < NVS; ++j) mt[j] = vmax_nan(mt[j], load(s + c * SB + j * W));
    bool rescale = false;
    const vf vmul = splat(mul);
    for (int j = 0; j < NVS; ++j) {
        mt[j] = mt[j] * vmul;  // mul > 0: the max of the products is the product of the max
        const vf mn = vmax_nan(m[j], mt[j]);
        ms[j] = mn == splat(NEG_INF) ? vf{} : mn;
        alpha[j] = vexp(m[j] - ms[j]);
        rescale |= any(mt[j] > m[j]);
        m[j] = mn;
    }
    static_assert(NVS == 2, "a pair-major row is SB = 2 vectors");
    const int64_t pairs = (kn + 1) / 2;
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t c0 = 2 * p, c1 = 2 * p + 1;
        float x[2][SB];
        for (int j = 0; j < NVS; ++j) {
            const vf p0 = vexp(load(s + c0 * SB + j * W) * vmul - ms[j]);
            const vf p1 = c1 < kn ? vexp(load(s + c1 * SB + j * W) * vmul - ms[j]) : vf{};
            sum[j] += p0 + p1;
            store(x[0] + j * W, p0);
            store(x[1] + j * W, p1);
        }
        pack_pair(x[0], x[1], p2 + p * 2 * SB);
    }
    for (int j = 0; j < NVS; ++j) l[j] = l[j] * alpha[j] + sum[j];
    if (rescale)
        for (int64_t d = 0; d < rows; ++d)
            for (int j = 0; j < NVS; ++j) store(ot + d * SB + j * W, load(ot + d * SB + j * W) * alpha[j]);
}

// The forward of bfloat16 inputs with bfloat16 dot products: Q K^T from K rows read in place
// (pairs of adjacent dims) against Q^T packed pair-major, P V from P^T packed pair-major (keys in
// pairs) against V^T packed key-pair-major per step; statistics as the float32 forward.
struct ForwardBF16 {
    static constexpr int64_t MERGE = 16;  // with AMX tiles: 1024 keys of 64 (4 or 8 blocks measured slower)
    const Problem& pb;
    View<const c10::BFloat16> q, k, v;
    View<c10::BFloat16> out;
    float* lse;
    View<const c10::BFloat16> vt;  // V^T (Dv x Lk per head) for AMX tiles, else p == nullptr
    const uint8_t* finite;          // with vt: 1 where key c's value row is finite, at vt's (b, h) offset / Dv
    struct State {
        Buffer<> s, o, kc;
        Buffer<c10::BFloat16> q2, p2, v2;
        std::vector<uint8_t> used;
    };

    void operator()(const Item& it, State& st) const {
        using bf16 = c10::BFloat16;
        const int64_t b = it.b, h = it.h, hk = h / pb.group;
        const PlanRow plan = plan_row(pb, b, h, it.qb);
        const int64_t end = pb.key_end(b);
        const float* band = pb.band_of(h);
        // with AMX tiles, up to MERGE adjacent full key blocks as one step: fewer, larger products
        // (and one softmax rescale) where the mask keeps whole runs of blocks; the dot-product path
        // keeps steps of one block (its V^T copy per step grows out of the caches)
        const int64_t merge = vt.p != nullptr ? MERGE : 1;
        const int64_t Dpair = (pb.D + 1) / 2, kpairs = (merge * pb.bk + 1) / 2;
        float* s = st.s.get(2 * kpairs * SB);  // an odd block's last pair padded with a zero row
        float* ot = st.o.get(pb.Dv * SB);
        bf16* q2 = st.q2.get(Dpair * 2 * SB);      // Q^T pair-major: (D/2, SB, 2)
        bf16* p2 = st.p2.get(kpairs * 2 * SB);     // P^T pair-major: (kn/2, SB, 2)
        bf16* v2 = st.v2.get(pb.Dv * kpairs * 2);  // V^T with keys in pairs: (Dv, kn/2, 2)
        bf16* kc = reinterpret_cast<bf16*>(st.kc.get(merge * pb.bk * (Dpair + 1)));  // K rows, dims padded even
        st.used.resize(pb.bk);
        for (int64_t r0 = it.qb * pb.bq; r0 < std::min((it.qb + 1) * pb.bq, pb.Lq); r0 += SB) {
            const int64_t n = std::min<int64_t>(SB, pb.Lq - r0);
            const int64_t row_in_block = r0 - it.qb * pb.bq;
            // Q^T pair-major: pair p of row j (dims 2p, 2p + 1 as one 32-bit word) at word p * SB + j
            uint32_t* q2w = reinterpret_cast<uint32_t*>(q2);
            for (int64_t j = 0; j < SB; ++j) {
                const bf16* qr = j < n ? q.row(b, h, r0 + j) : nullptr;
                for (int64_t p = 0; p < Dpair; ++p) {
                    uint32_t w = 0;
                    if (qr && 2 * p + 1 < pb.D)
                        std::memcpy(&w, qr + 2 * p, 4);
                    else if (qr)
                        w = qr[2 * p].x;  // an odd D: the last pair's second dim is 0
                    q2w[p * SB + j] = w;
                }
            }
            std::fill_n(ot, pb.Dv * SB, 0.0f);
            Online soft;
            for (int64_t t = 0; t < plan.num; ++t) {
                Step step;
                if (!open_step(pb, plan, t, end, row_in_block, n, st.used.data(), step)) continue;
                if (plan.tid[t] < 0)  // a full block: the full blocks right after it join the step
                    while (step.kn % pb.bk == 0 && step.kn < merge * pb.bk && t + 1 < plan.num && plan.tid[t + 1] < 0 &&
                           int64_t(plan.idx[t + 1]) * pb.bk == step.k0 + step.kn) {
                        const int64_t more = std::min(pb.bk, end - (step.k0 + step.kn));
                        if (more <= 0) break;
                        step.kn += more;
                        ++t;
                    }
                const bool clean = !step.all_used;
                // K in place with AMX tiles: a key no row uses is hidden from every row (the step is
                // masked then), so its score, whatever K holds, becomes -inf in modify_scores
                int64_t kstride;
                const bf16* krows = bf16_rows(k.row(b, hk, step.k0), k.s2, step.kn, pb.D,
                                              clean && vt.p == nullptr ? st.used.data() : nullptr, kc, kstride);
                scores_bf16(step, Dpair, krows, kstride, q2, s);
                // the scale inside the softmax pass where it is the only modification
                const bool plain = pb.softcap == 0.0f && band == nullptr && !step.masked && pb.scale > 0.0f;
                if (!plain) modify_scores(pb, step, s, nullptr, band, r0);
                // P^T pair-major (an odd kn padded), then V^T with keys in pairs (unused keys 0)
                step_packed(soft, s, step.kn, plain ? pb.scale : 1.0f, ot, pb.Dv, p2);
                const int64_t pairs = (step.kn + 1) / 2;
                // V^T in place where the keys no row uses hold finite values (their weight is exactly
                // 0, and 0 x finite adds nothing; a NaN or Inf there must not reach the output)
                bool in_place = vt.p != nullptr && step.kn % 2 == 0;
                if (in_place && clean) {
                    const uint8_t* fin = finite + (vt.row(b, hk, 0) - vt.p) / pb.Dv + step.k0;
                    for (int64_t c = 0; c < step.kn && in_place; ++c) in_place = st.used[c] || fin[c];
                }
                if (in_place) {
                    gemm_bf16<true>(pb.Dv, pairs, vt.row(b, hk, 0) + step.k0, vt.s2, p2, ot, SB);
                    continue;
                }
                const bf16* vr = v.row(b, hk, step.k0);
                for (int64_t p = 0; p < pairs; ++p) {
                    const int64_t c0 = 2 * p, c1 = 2 * p + 1;
                    const bool u0 = !clean || st.used[c0], u1 = c1 < step.kn && (!clean || st.used[c1]);
                    const bf16* a0 = vr + c0 * v.s2;
                    const bf16* a1 = vr + c1 * v.s2;
                    for (int64_t d = 0; d < pb.Dv; ++d) {
                        v2[(d * pairs + p) * 2] = u0 ? a0[d] : bf16(0.0f);
                        v2[(d * pairs + p) * 2 + 1] = u1 ? a1[d] : bf16(0.0f);
                    }
                }
                gemm_bf16<true>(pb.Dv, pairs, v2, 2 * pairs, p2, ot, SB);
            }
            float* l = lse + (b * pb.Hq + h) * pb.Lq + r0;
            for (int64_t j = 0; j < n; ++j) {
                l[j] = soft.lse(j);
                const float inv = soft.inverse(j);
                bf16* dst = out.row(b, h, r0 + j);
                column_as_row(ot, pb.Dv, j, inv, dst);
            }
        }
    }
};

// V (B or 1, Hkv, Lk, Dv) bfloat16 as V^T (B or 1, Hkv, Dv, Lk), contiguous, and
// where the plan has partial tiles finite (B or 1, Hkv, Lk): 1 where a key's value row holds no NaN
// or Inf. The batch once where V is broadcast over it.
// 32 x 32 bfloat16 (rows of 64 bytes, row r at src + r * ld) transposed into dst (row d at dst + d * ldd):
// five rounds of two-register permutes, each swapping the off-diagonal halves of 2s x 2s blocks.
struct TransposeLanes {
    alignas(64) uint16_t lo[5][32], hi[5][32];  // round k (s = 16 >> k): new r[i] takes lane l - s of r[i + s] where l has bit s
    TransposeLanes() {
        for (int k = 0; k < 5; ++k)
            for (int l = 0, s = 16 >> k; l < 32; ++l) {
                lo[k][l] = uint16_t((l & s) ? 32 + l - s : l);
                hi[k][l] = uint16_t((l & s) ? 32 + l : l + s);
            }
    }
};

inline void transpose_32x32(const uint16_t* src, int64_t ld, uint16_t* dst, int64_t ldd) {
    static const TransposeLanes lanes;
    __m512i r[32];
    for (int i = 0; i < 32; ++i) r[i] = _mm512_loadu_si512(src + i * ld);
    for (int k = 0; k < 5; ++k) {
        const int s = 16 >> k;
        const __m512i ilo = _mm512_load_si512(lanes.lo[k]), ihi = _mm512_load_si512(lanes.hi[k]);
        for (int i = 0; i < 32; ++i) {
            if (i & s) continue;
            const __m512i a = r[i], b = r[i + s];
            r[i] = _mm512_permutex2var_epi16(a, ilo, b);
            r[i + s] = _mm512_permutex2var_epi16(a, ihi, b);
        }
    }
    for (int i = 0; i < 32; ++i) _mm512_storeu_si512(dst + i * ldd, r[i]);
}

void transpose_values(const at::Tensor& v, bool partial, at::Tensor& vt, at::Tensor& finite) {
    const at::Tensor one = v.stride(0) == 0 ? v.narrow(0, 0, 1) : v;
    const int64_t H = one.size(1), L = one.size(2), Dv = one.size(3);
    // 32 x 32 blocks in registers where the sizes allow: ATen's strided copy of the transposed view
    // was 9.4% of a bf16 document & causal forward under perf on the Xeon, these 3.4-4%
    if (L % 32 == 0 && Dv % 32 == 0) {
        vt = at::empty({one.size(0), H, Dv, L}, one.options());
        const View<const c10::BFloat16> src = view_of<const c10::BFloat16>(one);
        uint16_t* dst = reinterpret_cast<uint16_t*>(vt.data_ptr<c10::BFloat16>());
        const int64_t kb = L / 32, db = Dv / 32;
        at::parallel_for(0, one.size(0) * H * kb, 1, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) {
                const int64_t bh = i / kb, c0 = (i % kb) * 32;
                const uint16_t* rows = reinterpret_cast<const uint16_t*>(src.row(bh / H, bh % H, c0));
                for (int64_t d0 = 0; d0 < db * 32; d0 += 32)
                    transpose_32x32(rows + d0, src.s2, dst + (bh * Dv + d0) * L + c0, L);
            }
        });
    } else {
        vt = one.transpose(2, 3).contiguous();
    }
    if (!partial) return;
    finite = at::empty({one.size(0), H, L}, one.options().dtype(at::kByte));
    const View<const c10::BFloat16> src = view_of<const c10::BFloat16>(one);
    uint8_t* fin = finite.data_ptr<uint8_t>();
    at::parallel_for(0, one.size(0) * H, 1, [&](int64_t begin, int64_t end) {
        for (int64_t bh = begin; bh < end; ++bh)
            for (int64_t c = 0; c < L; ++c) {
                const uint16_t* row = reinterpret_cast<const uint16_t*>(src.row(bh / H, bh % H, c));
                uint16_t bad = 0;
                for (int64_t d = 0; d < Dv; ++d) bad |= uint16_t((row[d] & 0x7f80) == 0x7f80);  // Inf or NaN
                fin[bh * L + c] = bad == 0;
            }
    });
}

// The forward of bfloat16 inputs on the bfloat16 products (AMX tiles: V^T once per call, the
// products being cheap next to transposing V per step). True: it ran.
inline bool forward_bf16(const Problem& pb, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& tile_ids, at::Tensor& out, at::Tensor& lse) {
    using T = c10::BFloat16;
    at::Tensor vt, finite;
    View<const T> vtv{nullptr, 0, 0, 0};
    if (amx_tiles()) {
        // the finite check only where some listed block is partial (bits always holds one tile)
        const int32_t* tid = tile_ids.data_ptr<int32_t>();
        const bool partial = std::any_of(tid, tid + tile_ids.numel(), [](int32_t x) { return x >= 0; });
        transpose_values(v, partial, vt, finite);
        vtv = view_of<const T>(vt);
        if (vt.size(0) == 1) vtv.s0 = 0;  // V broadcast over the batch
    }
    run_items(forward_items(pb), ForwardBF16{pb, view_of<const T>(q), view_of<const T>(k), view_of<const T>(v),
                                             view_of<T>(out), lse.data_ptr<float>(), vtv,
                                             finite.defined() ? finite.data_ptr<uint8_t>() : nullptr});
    return true;
}

// The backward of bfloat16 inputs recomputes the scores with the forward's products (bit for bit).
template <>
struct StepScores<c10::BFloat16> {
    struct State {
        Buffer<c10::BFloat16> q2, kb;
        c10::BFloat16* packed = nullptr;  // Q^T pair-major, made by begin()
    };
    void begin(State& st, const Problem& pb, const float* qt) const {
        const int64_t Dpair = (pb.D + 1) / 2;
        st.packed = st.q2.get(Dpair * 2 * SB);
        pack_columns(qt, Dpair, st.packed);
    }
    void operator()(State& st, const Problem& pb, const Step& step, const c10::BFloat16* k0, int64_t k_stride,
                    const uint8_t* used, const float*, float*, float* s) const {
        // K in place as the forward reads it with AMX tiles (a key no row uses is hidden from every
        // row: its score becomes -inf whatever K holds), but not under a softcap, whose tanh of such
        // a score the backward keeps
        const int64_t Dpair = (pb.D + 1) / 2;
        int64_t kstride;
        const uint8_t* zeroed = pb.softcap > 0.0f ? used : nullptr;
        const c10::BFloat16* kr = bf16_rows(k0, k_stride, step.kn, pb.D, zeroed, st.kb.get(pb.bk * 2 * Dpair), kstride);
        scores_bf16(step, Dpair, kr, kstride, st.packed, s);
    }
};

// The backward's products with AMX tiles in bfloat16 (as PyTorch's CPU flash backward: P and dS
// rounded to bfloat16, every sum float32). Operands, each packed once per 32 rows from its float32
// copy (exact: they are widened bfloat16): dO^T pair-major by dims (for dP^T = V dO^T, V rows in
// place), dO and Q pair-major by rows (for dV += P^T dO and dK += dS^T Q). Per step: P^T and dS^T
// narrowed, dS^T pair-major by keys (for dQ^T += K^T dS^T, K^T made once per call and read in
// place where the step's keys are even and those no row uses are finite, else copied with them
// zeroed). With the AVX512-BF16 dot products (no AMX) the float32 products stay: measured on a
// Xeon with ATTNKIT_NATIVE_AMX=0, bfloat16 dot products there made document & causal's backward
// 1.4x slower (their peak equals float32 FMAs' on that core, and the packing is extra work).
template <>
struct StepGrads<c10::BFloat16> {
    using bf16 = c10::BFloat16;
    bool tiles = false;                     // AMX tiles: else WidenedGrads's float32 products
    View<const bf16> kt{nullptr, 0, 0, 0};  // K^T (B or 1, Hkv, D, Lk)
    const uint8_t* finite = nullptr;        // 1 where key c's row of K is finite, at kt's (b, h) offset / D; or null
    struct State {
        Buffer<bf16> dot2, do2, q2, qz2, vb, p16, d16, ds2, kt2;
        const bf16 *dot_pairs = nullptr, *do_pairs = nullptr, *q_pairs = nullptr;  // begin()'s packs
        WidenedGrads<bf16>::State widened;
    };
    static constexpr WidenedGrads<bf16> widened{};

    // K^T for the call and, where some listed block is partial (keys no row uses), K's finite rows
    static StepGrads make(const at::Tensor& k, const at::Tensor& tile_ids, at::Tensor& kt, at::Tensor& finite) {
        if (!amx_tiles()) return {};
        const int32_t* tid = tile_ids.data_ptr<int32_t>();
        const bool partial = std::any_of(tid, tid + tile_ids.numel(), [](int32_t x) { return x >= 0; });
        transpose_values(k, partial, kt, finite);
        StepGrads g;
        g.tiles = true;
        g.kt = view_of<const bf16>(kt);
        if (kt.size(0) == 1) g.kt.s0 = 0;  // K broadcast over the batch
        g.finite = finite.defined() ? finite.data_ptr<uint8_t>() : nullptr;
        return g;
    }

    void begin(State& st, const Problem& pb, const float* qr, const float* dor, const float* dot) const {
        if (!tiles) return;
        bf16* dot2 = st.dot2.get((pb.Dv + 1) / 2 * 2 * SB);
        bf16* do2 = st.do2.get(SB * pb.Dvp);
        bf16* q2 = st.q2.get(SB * pb.Dp);
        pack_columns(dot, (pb.Dv + 1) / 2, dot2);
        for (int64_t p = 0; p < SB / 2; ++p) {
            pack_pair(dor + 2 * p * pb.Dvp, dor + (2 * p + 1) * pb.Dvp, pb.Dvp, do2 + p * 2 * pb.Dvp);
            pack_pair(qr + 2 * p * pb.Dp, qr + (2 * p + 1) * pb.Dp, pb.Dp, q2 + p * 2 * pb.Dp);
        }
        st.dot_pairs = dot2, st.do_pairs = do2, st.q_pairs = q2;
    }

    void dp(State& st, const Problem& pb, const Step& step, const bf16* v0, int64_t v_stride, float* vc, const float* dot,
            float* dpt) const {
        if (!tiles) return widened.dp(st.widened, pb, step, v0, v_stride, vc, dot, dpt);
        const int64_t pairs = (pb.Dv + 1) / 2;
        int64_t vstride;
        const bf16* vr = bf16_rows(v0, v_stride, step.kn, pb.Dv, nullptr, st.vb.get(pb.bk * 2 * pairs), vstride);
        gemm_bf16<false>(step.kn, pairs, vr, vstride, st.dot_pairs, dpt, SB);
    }

    void grads(State& st, const Problem& pb, const Step& step, int64_t b, int64_t hk, const bf16* k0, int64_t k_stride,
               const uint8_t* used, int64_t n, float* kc, const float* qr, float* qc, const float* dor, const float* p,
               const float* ds, float* dv, float* dk, float* dqt) const {
        if (!tiles)
            return widened.grads(st.widened, pb, step, b, hk, k0, k_stride, used, n, kc, qr, qc, dor, p, ds, dv, dk, dqt);
        const int64_t kn = step.kn, pairs = (kn + 1) / 2;
        bf16* p16 = st.p16.get(kn * SB);
        bf16* d16 = st.d16.get(kn * SB);
        bf16* ds2 = st.ds2.get(pairs * 2 * SB);
        narrow_bf16(p, kn * SB, p16);
        narrow_bf16(ds, kn * SB, d16);
        alignas(64) static const float zero[SB] = {};
        for (int64_t x = 0; x < pairs; ++x)
            pack_pair(ds + 2 * x * SB, 2 * x + 1 < kn ? ds + (2 * x + 1) * SB : zero, ds2 + x * 2 * SB);
        // dV[k0:] (kn x Dvp) += P^T (kn x SB) dO (SB x Dvp)
        gemm_bf16<true>(kn, pb.Dvp, SB / 2, p16, SB, st.do_pairs, dv + step.k0 * pb.Dvp, pb.Dvp);
        // dK[k0:] (kn x Dp) += dS^T (kn x SB) Q (SB x Dp), Q rows that see no key of the step zeroed
        const bf16* q2 = st.q_pairs;
        if (step.seen != first_rows(n)) {
            bf16* qz = st.qz2.get(SB * pb.Dp);
            std::memcpy(qz, q2, SB * pb.Dp * sizeof(bf16));
            for (int64_t j = 0; j < SB; ++j)
                if (!(j < n && ((step.seen >> j) & 1u)))
                    for (int64_t d = 0; d < pb.Dp; ++d) qz[((j / 2) * pb.Dp + d) * 2 + (j & 1)] = bf16(0.0f);
            q2 = qz;
        }
        gemm_bf16<true>(kn, pb.Dp, SB / 2, d16, SB, q2, dk + step.k0 * pb.Dp, pb.Dp);
        // dQ^T (D x SB) += K^T (D x kn) dS^T (kn x SB)
        bool in_place = kn % 2 == 0;
        if (in_place && used != nullptr) {
            const uint8_t* fin = finite ? finite + (kt.row(b, hk, 0) - kt.p) / pb.D + step.k0 : nullptr;
            for (int64_t c = 0; c < kn && in_place; ++c) in_place = used[c] || (fin != nullptr && fin[c]);
        }
        if (in_place) {
            gemm_bf16<true>(pb.D, pairs, kt.row(b, hk, 0) + step.k0, kt.s2, ds2, dqt, SB);
            return;
        }
        bf16* k2 = st.kt2.get(pb.D * pairs * 2);  // K^T with keys in pairs, keys no row uses 0
        for (int64_t x = 0; x < pairs; ++x) {
            const int64_t c0 = 2 * x, c1 = 2 * x + 1;
            const bool u0 = used == nullptr || used[c0], u1 = c1 < kn && (used == nullptr || used[c1]);
            const bf16* a0 = k0 + c0 * k_stride;
            const bf16* a1 = k0 + c1 * k_stride;
            for (int64_t d = 0; d < pb.D; ++d) {
                k2[(d * pairs + x) * 2] = u0 ? a0[d] : bf16(0.0f);
                k2[(d * pairs + x) * 2 + 1] = u1 ? a1[d] : bf16(0.0f);
            }
        }
        gemm_bf16<true>(pb.D, pairs, k2, 2 * pairs, ds2, dqt, SB);
    }
};

inline std::string bf16_info() {
    return amx_tiles() ? "bfloat16: AMX tiles (oneDNN brgemm)" : "bfloat16: AVX512-BF16 dot products";
}
#else
inline bool forward_bf16(const Problem&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         at::Tensor&, at::Tensor&) {
    return false;  // no bfloat16 products here: the float32 code runs on widened tiles
}
inline std::string bf16_info() { return "bfloat16: widened to float32"; }
#endif

}  // namespace
