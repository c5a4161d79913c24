// attnkit native engine, stage 5: few query rows (decoding): one dot product per score.
#pragma once

#include "plan.h"

namespace {

// ---- few query rows (decoding) ----------------------------------------------------------------
//
// A call of at most FEW_ROWS queries (a decoding step, a few speculative tokens) would compute
// SB = 32 rows of scores for each of them in the tile path. Here one item is a sequence, a K/V
// head and up to ITEM_ROWS rows (the group's query heads x the queries, when the plan is the
// same for those heads): each key is read once for all of them, each score is one dot product,
// and the online softmax runs per row over steps of up to SPAN keys (whole listed blocks). Only
// the keys some row sees are read, and each row's P V sums only the keys it sees: NaN or inf
// stored anywhere a query may not look never reaches its output (exact per element).
// The scores equal the tile path's to rounding; the backward (tile path) renormalises P over
// each row's keys, so weights of 0 and 1 stay exact between them.

constexpr int64_t FEW_ROWS = 8;    // calls of at most this many queries take the row path
constexpr int64_t ITEM_ROWS = 16;  // rows (query heads x queries) of one item
constexpr int64_t SPAN = 512;      // keys of one step (whole key blocks): few, long streams of K and V


// Horizontal sums of W vectors at once: a[i] (i < W) becomes lane i of the result. Each level
// folds pairs of vectors whose keys hold S lanes each into one whose keys hold S / 2, keys in
// order (lanes l of z: key l / (S / 2), from x for the first half of the keys, y for the rest).
template <int S>
struct FoldLanes {
    int32_t lo[W], hi[W];
    constexpr FoldLanes() : lo{}, hi{} {
        constexpr int h = S / 2, m = W / S;
        for (int l = 0; l < W; ++l) {
            const int seg = l / h, o = l % h;
            lo[l] = seg < m ? seg * S + o : W + (seg - m) * S + o;
            hi[l] = lo[l] + h;
        }
    }
};
template <int S>
inline vf fold_pair(vf x, vf y) {
    static constexpr FoldLanes<S> lanes{};
    vi lo, hi;
    std::memcpy(&lo, lanes.lo, sizeof(vi));
    std::memcpy(&hi, lanes.hi, sizeof(vi));
    return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}
template <int S>
inline void fold_level(vf* a, int n) {
    for (int i = 0; i < n / 2; ++i) a[i] = fold_pair<S>(a[2 * i], a[2 * i + 1]);
    if constexpr (S > 2) fold_level<S / 2>(a, n / 2);
}
inline vf hsums(vf* a) {
    fold_level<W>(a, W);
    return a[0];
}

// The scores of the row path: lane c is the dot product of query row qrow with key row kr[c]
// (float32 rows of Dp dims, zero-padded), summed in W-lane chunks and folded. The forward of a
// few rows and its backward both compute them here, so the backward's scores are bit for bit
// the forward's (a row with one key has the weight 1 exactly, and its gradients the formula's).
template <typename K>
inline vf row_dots(const K* const* kr, const float* qrow, int64_t Dp) {
    vf acc[W];
    // key by key, each row read front to back (the order of memory, which the hardware's prefetcher
    // follows; reading the W rows a vector at a time each took 1.5x as long from memory: 4 sequences of
    // 4096 keys, 8 heads, one thread, 5.4-5.6 -> 3.4-3.8 ms)
#pragma GCC unroll 16
    for (int c = 0; c < W; ++c) {
        vf a{};
        for (int64_t x = 0; x < Dp; x += W) a += load(qrow + x) * load_wide(kr[c] + x);
        acc[c] = a;
    }
    return hsums(acc);
}
inline float hmax_nan(vf x) {
    float m = x[0];
    for (int i = 1; i < W; ++i) m = (x[i] > m || x[i] != x[i]) ? x[i] : m;
    return m;
}

// Row src (width elements) as float32 at dst, zero-padded to padded (a multiple of W).
template <typename T>
inline const float* padded_row(const T* src, int64_t width, int64_t padded, float* dst) {
    if constexpr (std::is_same_v<T, float>)
        if (width == padded) return src;
    for (int64_t x = 0; x < width; ++x) dst[x] = widen(src[x]);
    for (int64_t x = width; x < padded; ++x) dst[x] = 0.0f;
    return dst;
}

// o[0, NV * W) += the sum over the step's n keys u that the row sees (sees(u)) of p[u] times
// V row u's [x0, x0 + NV * W) (row(u): the row as float32), NV vectors of o in registers (a
// compile-time count: no per-key test of which are live)
template <int NV, typename Row, typename Sees>
inline void pv_part(float* orow, const float* p, int64_t n, int64_t x0, const Row& row, const Sees& sees) {
    vf acc[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[j] = vf{};
    for (int64_t u = 0; u < n; ++u) {
        if (!sees(u)) continue;  // a key this query may not see adds nothing, NaN included
        const vf pu = splat(p[u]);
        const auto* vr = row(u) + x0;
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) acc[j] += pu * load_wide(vr + j * W);
    }
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) store(orow + j * W, load(orow + j * W) + acc[j]);
}

// O row += P row V over the step, Dvp columns: four vectors at a time, then one
template <typename Row, typename Sees>
inline void pv(float* orow, const float* p, int64_t n, int64_t Dvp, const Row& row, const Sees& sees) {
    int64_t x0 = 0;
    for (; x0 + 4 * W <= Dvp; x0 += 4 * W) pv_part<4>(orow + x0, p, n, x0, row, sees);
    for (; x0 < Dvp; x0 += W) pv_part<1>(orow + x0, p, n, x0, row, sees);
}

// Where a row's listed blocks are all full (no tile of bits) and follow each other up to the
// sequence's end: true, with the keys [run[0], run[1]) (a padding mask's or no mask's plan).
inline bool dense_run(const PlanRow& plan, int64_t end, int64_t bk, int64_t* run) {
    run[0] = run[1] = 0;
    bool first = true;
    for (int64_t t = 0; t < plan.num; ++t) {
        const int64_t k0 = int64_t(plan.idx[t]) * bk, kn = std::min(bk, end - k0);
        if (kn <= 0) continue;
        if (plan.tid[t] >= 0 || (!first && k0 != run[1])) return false;
        if (first) run[0] = k0, first = false;
        run[1] = k0 + kn;
    }
    return true;
}

template <typename T>
struct ForwardFew {
    const Problem& pb;
    View<const T> q, k, v;
    View<T> out;
    float* lse;
    int64_t heads;  // query heads of one item
    struct State {
        Buffer<> qf, s, o, kr, vr;
        std::vector<int64_t> keys;        // the step's keys some row sees
        std::vector<uint32_t> bits;       // bit i: query i sees that key
        std::vector<const float*> vrows;  // their V rows as float32
    };

    void operator()(const Item& it, State& st) const {
        const int64_t b = it.b, hk = it.h, h0 = hk * pb.group + it.qb * heads;
        const int64_t nh = std::min(heads, (hk + 1) * pb.group - h0), Lq = pb.Lq, R = nh * Lq;
        const PlanRow plan = plan_row(pb, b, h0, 0);  // the same for the item's heads (Hm == 1 or one head)
        const int64_t end = pb.key_end(b);
        const int64_t Dp = round_up(pb.D, W), Dvp = round_up(pb.Dv, W);
        const int64_t span = std::max<int64_t>(1, SPAN / pb.bk) * pb.bk, sp = round_up(span, W);
        float* qf = st.qf.get(R * Dp);  // row r: head h0 + r / Lq, query r % Lq
        float* s = st.s.get(R * sp);    // row-major: s[r * sp + column]
        float* o = st.o.get(R * Dvp);
        float* kbuf = st.kr.get((W + 1) * Dp);
        const float* zeros = kbuf + W * Dp;  // the row read in place of keys past the step's last
        std::fill_n(kbuf + W * Dp, Dp, 0.0f);
        float* vbuf = std::is_same_v<T, float> && pb.Dv == Dvp ? nullptr : st.vr.get(span * Dvp);
        st.keys.resize(span), st.bits.resize(span), st.vrows.resize(span);
        int64_t* keys = st.keys.data();
        uint32_t* bits = st.bits.data();
        const float** vrows = st.vrows.data();
        for (int64_t r = 0; r < R; ++r) {
            const T* src = q.row(b, h0 + r / Lq, r % Lq);
            for (int64_t x = 0; x < pb.D; ++x) qf[r * Dp + x] = widen(src[x]);
            for (int64_t x = pb.D; x < Dp; ++x) qf[r * Dp + x] = 0.0f;
        }
        std::fill_n(o, R * Dvp, 0.0f);
        float m[ITEM_ROWS], l[ITEM_ROWS];
        for (int64_t r = 0; r < R; ++r) m[r] = NEG_INF, l[r] = 0.0f;
        const uint32_t all = first_rows(Lq);
        // One step's scores, W keys at a time: kr(c) is the step's c-th key row as float32 (W
        // independent dot products, folded together at the end)
        auto scores = [&](int64_t n, const auto& krow) {
            using K = std::remove_cv_t<std::remove_pointer_t<decltype(krow(0, 0))>>;  // float32 or bfloat16 rows
            const K* none = reinterpret_cast<const K*>(zeros);                         // (0 bits: 0.0 in both)
            for (int64_t c0 = 0; c0 < n; c0 += W) {
                const K* kr[W];
                for (int64_t c = 0; c < W; ++c) kr[c] = c0 + c < n ? krow(c0 + c, c) : none;
                // no software prefetch: the keys of a step are consecutive rows, which the hardware's
                // stream prefetcher follows; asking for K two groups ahead and V during the scores
                // filled the line-fill buffers and stalled there (perf: 60% of this loop's samples on
                // the prefetches; without them one query over 4096 keys, 8 heads, fp32, 1.29x -> 1.21x
                // SDPA's time on an Intel Xeon; V alone prefetched 1.35-1.42x)
                for (int64_t r = 0; r < R; ++r) store(s + r * sp + c0, row_dots(kr, qf + r * Dp, Dp));
            }
        };
        // The modifications of one step's scores, in the tile path's order (scale or soft-capping,
        // the band, the mask: key(c) is the step's c-th key, hidden(c, i) whether query i may not
        // see it), and each row's online softmax over the step: s becomes P
        auto softmax = [&](int64_t n, const auto& key, const auto& hidden) {
            const int64_t np = round_up(n, W);
            for (int64_t r = 0; r < R; ++r) {
                float* sr = s + r * sp;
                const int64_t i = r % Lq;
                if (pb.softcap > 0.0f) {
                    for (int64_t c = 0; c < np; c += W) store(sr + c, capped(pb, load(sr + c), nullptr));
                } else {
                    for (int64_t c = 0; c < np; c += W) store(sr + c, load(sr + c) * splat(pb.scale));
                }
                if (const float* band = pb.band_of(h0 + r / Lq))
                    for (int64_t c = 0; c < n; ++c) sr[c] += band[pb.Lk - 1 - key(c) + i];
                for (int64_t c = 0; c < n; ++c)
                    if (hidden(c, i)) sr[c] = NEG_INF;
                for (int64_t c = n; c < np; ++c) sr[c] = NEG_INF;
                vf mt = splat(NEG_INF);
                for (int64_t c = 0; c < np; c += W) mt = vmax_nan(mt, load(sr + c));
                const float bm = hmax_nan(mt);
                const float mn = (bm > m[r] || bm != bm) ? bm : m[r];  // NaN-aware, as vmax_nan
                const float ms = mn == NEG_INF ? 0.0f : mn;
                const float alpha = vexp(splat(m[r] - ms))[0];  // 0 while m is -inf, NaN once it is NaN
                vf sum{};
                for (int64_t c = 0; c < np; c += W) {
                    const vf p = vexp(load(sr + c) - splat(ms));
                    sum += p;
                    store(sr + c, p);
                }
                if (bm > m[r])
                    for (int64_t x = 0; x < Dvp; x += W) store(o + r * Dvp + x, load(o + r * Dvp + x) * splat(alpha));
                l[r] = l[r] * alpha + hsum(sum);
                m[r] = mn;
            }
        };
        bool ran = false;
        if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
            int64_t run[2] = {0, 0};
            ran = pb.D == Dp && pb.Dv == Dvp && dense_run(plan, end, pb.bk, run);
            // every listed block is full and they follow each other: keys [run[0], run[1]), each seen
            // by every row, float32 or bfloat16 rows read in place (bfloat16 widened in the registers);
            // no list of keys, no test per key, no copy
            const T* kbase = k.row(b, hk, 0);
            const T* vbase = v.row(b, hk, 0);
            for (int64_t k0 = run[0]; ran && k0 < run[1]; k0 += span) {
                const int64_t n = std::min(span, run[1] - k0);
                scores(n, [&](int64_t c, int64_t) { return kbase + (k0 + c) * k.s2; });
                softmax(n, [&](int64_t c) { return k0 + c; }, [](int64_t, int64_t) { return false; });
                const T* v0 = vbase + k0 * v.s2;
                for (int64_t r = 0; r < R; ++r)
                    pv(o + r * Dvp, s + r * sp, n, Dvp, [&](int64_t u) { return v0 + u * v.s2; }, [](int64_t) { return true; });
            }
        }
        if (!ran) {
            for (int64_t t = 0; t < plan.num;) {
                // one step: the keys some row sees in the next listed blocks, whole blocks up to SPAN keys
                int64_t n = 0;
                for (; t < plan.num; ++t) {
                    const int64_t k0 = int64_t(plan.idx[t]) * pb.bk, kn = std::min(pb.bk, end - k0);
                    if (kn <= 0) continue;
                    if (n + kn > span) break;
                    const uint8_t* tile = plan.tid[t] >= 0 ? pb.bits + int64_t(plan.tid[t]) * pb.bk * (pb.bq / 8) : nullptr;
                    for (int64_t c = 0; c < kn; ++c) {
                        const uint32_t w = tile ? uint32_t(tile[c * (pb.bq / 8)]) & all : all;  // Lq <= 8: byte 0 holds the rows
                        if (w) keys[n] = k0 + c, bits[n++] = w;
                    }
                }
                if (n == 0) continue;
                scores(n, [&](int64_t c, int64_t slot) { return padded_row(k.row(b, hk, keys[c]), pb.D, Dp, kbuf + slot * Dp); });
                softmax(n, [&](int64_t c) { return keys[c]; },
                        [&](int64_t c, int64_t i) { return all != 1u && !((bits[c] >> i) & 1u); });
                // O (R x Dv) += P V, 4 vectors of a row's O in registers
                for (int64_t u = 0; u < n; ++u)
                    vrows[u] = padded_row(v.row(b, hk, keys[u]), pb.Dv, Dvp, vbuf ? vbuf + u * Dvp : nullptr);
                for (int64_t r = 0; r < R; ++r) {
                    const uint32_t row = 1u << (r % Lq);
                    pv(o + r * Dvp, s + r * sp, n, Dvp, [&](int64_t u) { return vrows[u]; },
                       [&](int64_t u) { return (bits[u] & row) != 0; });
                }
            }
        }
        for (int64_t r = 0; r < R; ++r) {
            const int64_t h = h0 + r / Lq, i = r % Lq;
            const float lr = l[r];
            lse[(b * pb.Hq + h) * pb.Lq + i] = lr > 0.0f ? m[r] + std::log(lr) : (lr == 0.0f ? NEG_INF : NaN);
            const float inv = lr > 0.0f ? 1.0f / lr : (lr == 0.0f ? 0.0f : NaN);
            T* dst = out.row(b, h, i);
            for (int64_t x = 0; x < pb.Dv; ++x) dst[x] = narrow<T>(o[r * Dvp + x] * inv);
        }
    }
};

// Items (sequence, K/V head, chunk of its query heads): the heads of a group share one item
// when the plan is the same for them (Hm == 1), as many as ITEM_ROWS rows allow, fewer while
// there would be fewer items than twice the threads.
std::vector<Item> few_items(const Problem& pb, int64_t& heads) {
    heads = pb.Hm == 1 ? std::max<int64_t>(1, std::min<int64_t>(pb.group, ITEM_ROWS / pb.Lq)) : 1;
    const int64_t want = 2 * at::get_num_threads();
    while (heads > 1 && pb.B * pb.Hkv * ((pb.group + heads - 1) / heads) < want) heads = (heads + 1) / 2;
    const int64_t chunks = (pb.group + heads - 1) / heads;
    std::vector<Item> items;
    for (int64_t b = 0; b < pb.B; ++b)
        for (int64_t hk = 0; hk < pb.Hkv; ++hk)
            for (int64_t c = 0; c < chunks; ++c) items.push_back({b, hk, c});
    return items;
}

}  // namespace
