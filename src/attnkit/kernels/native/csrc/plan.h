// attnkit native engine, stage 3: one call's sizes and plan, the steps of a row block (its listed
// key blocks, their bits), the score modifications, and the work items on PyTorch's threads.
#pragma once

#include "amx.h"

namespace {

// ---- one call: sizes, plan, modifications --------------------------------------------------

struct Problem {
    int64_t B, Hq, Hkv, Lq, Lk, D, Dv, group;
    // the plan
    int64_t Bm, Hm, nq, nk, bq, bk;
    const int32_t* kv_num;
    const int32_t* kv_idx;
    const int32_t* tile_ids;
    const uint8_t* bits;
    const int64_t* kv_limit;
    int64_t Bl;
    // score modifications
    float scale;
    float softcap;   // 0: none
    float cap_mul;   // the tanh's argument is s * cap_mul (scale / softcap) ...
    bool cap_split;  // ... or (s * scale) / softcap where scale / softcap is no normal float32
    // ... and below |s| < 0.625 / cap_mul, i.e. s^2 < cap_w, the polynomial of vtanh with cap_mul folded into
    // its coefficients: softcap * tanh(s * cap_mul) = u + u w Q(w), u = s * scale, w = s^2, cap_q[j] =
    // TANH_P[j] cap_mul^(2j + 2) (computed in double); where one of them is no normal float32, cap_fold is false
    bool cap_fold;
    float cap_w;
    float cap_q[5];
    const float* band_rev;  // (band_heads, Lq + Lk - 1 + SB): bias(kv - q) of head h at
    int64_t band_heads;     // band_rev[h, Lk - 1 - kv + q], zero past Lq + Lk - 1
    // backward
    int64_t chunks, Dp, Dvp;
    bool delta_from_out;  // delta = rowsum(dO O): a part of the keys (the merged out and lse)
    bool band_grad;       // sum dS along each diagonal into the band's gradient

    int64_t key_end(int64_t b) const {
        if (!kv_limit) return Lk;
        return std::max<int64_t>(0, std::min(Lk, kv_limit[Bl == 1 ? 0 : b]));
    }
    const float* band_of(int64_t h) const {
        return band_rev ? band_rev + (band_heads == 1 ? 0 : h) * (Lq + Lk - 1 + SB) : nullptr;
    }
};

// Where one tensor of the call lives: (B, H, L, X) with a unit stride in X.
template <typename T>
struct View {
    T* p;
    int64_t s0, s1, s2;
    T* row(int64_t b, int64_t h, int64_t i) const { return p + b * s0 + h * s1 + i * s2; }
};
template <typename T>
View<T> view_of(const at::Tensor& t) {
    return {reinterpret_cast<T*>(t.data_ptr()), t.stride(0), t.stride(1), t.stride(2)};
}

// The part of the plan one row block reads: its listed key blocks and their tiles.
struct PlanRow {
    int64_t num;
    const int32_t* idx;
    const int32_t* tid;
};
inline PlanRow plan_row(const Problem& pb, int64_t b, int64_t h, int64_t qb) {
    const int64_t bm = pb.Bm == 1 ? 0 : b, hm = pb.Hm == 1 ? 0 : h;
    const int64_t at = (bm * pb.Hm + hm) * pb.nq + qb;
    return {pb.kv_num[at], pb.kv_idx + at * pb.nk, pb.tile_ids + at * pb.nk};
}

// Scratch of one thread (aligned to 64 bytes).
template <typename T = float>
struct Buffer {
    std::vector<T> data;
    T* get(size_t n) {
        const size_t pad = 64 / sizeof(T);
        if (data.size() < n + pad) data.resize(n + pad);
        uintptr_t p = reinterpret_cast<uintptr_t>(data.data());
        return reinterpret_cast<T*>((p + 63) & ~uintptr_t(63));
    }
};

// One key block seen by SB query rows: its keys, its tile of bits, what the rows use of it.
struct Step {
    int64_t k0, kn;
    const uint8_t* bits;  // the tile's row of key 0 at these rows' first byte, or null
    bool masked;         // some pair of the step is hidden (bits apply)
    bool all_used;       // every key is seen by some of these rows
    uint32_t seen;       // bit j: row j sees some key of the step
};

// Scan a partial tile for n <= SB rows: whether any pair is kept, whether all are, which keys
// are used (by some row) and which rows see some key (bit j: row j).
struct Scan {
    bool any, all, all_used;
    uint32_t seen;
};
Scan scan(const Problem& pb, const uint8_t* tile, int64_t kn, int64_t n, uint8_t* used) {
    const uint32_t rows = first_rows(n);
    Scan sc{false, true, true, 0};
    for (int64_t c = 0; c < kn; ++c) {
        const uint32_t w = mask_word(tile + c * (pb.bq / 8)) & rows;
        used[c] = w != 0;
        sc.seen |= w;
        sc.all &= w == rows;
        sc.all_used &= w != 0;
    }
    sc.any = sc.seen != 0;
    return sc;
}

// A step of a partial tile keeps the keys from the first to the last one its rows see, cut at
// multiples of this (the vector width of AVX-512, two of AVX2's): the keys left out are hidden
// from every row of the step.
constexpr int64_t TRIM_KEYS = 16;

// Step i of a plan row for the n <= SB rows at row_in_block of its row block, with ``used`` filled
// for a partial block; false when the keys are past the limit or these rows see none of them.
bool open_step(const Problem& pb, const PlanRow& plan, int64_t i, int64_t end, int64_t row_in_block, int64_t n,
               uint8_t* used, Step& step) {
    step = Step{int64_t(plan.idx[i]) * pb.bk, 0, nullptr, false, true, first_rows(n)};
    step.kn = std::min(pb.bk, end - step.k0);
    if (step.kn <= 0) return false;
    if (plan.tid[i] >= 0) {
        const uint8_t* bits = pb.bits + int64_t(plan.tid[i]) * pb.bk * (pb.bq / 8) + row_in_block / 8;
        // the keys before the first and past the last one these rows see are left out of the step
        // (rows 0-31 of a causal diagonal tile see its keys 0-31 of 128; a window's lower edge, a
        // document's first rows): cut at multiples of TRIM_KEYS, so k0 stays even (the bfloat16
        // paths read keys in pairs from it)
        const uint32_t rows = first_rows(n);
        const int64_t stride = pb.bq / 8;
        int64_t last = step.kn;
        while (last > 0 && (mask_word(bits + (last - 1) * stride) & rows) == 0) --last;
        if (last == 0) return false;
        int64_t first = 0;
        while ((mask_word(bits + first * stride) & rows) == 0) ++first;
        first -= first % TRIM_KEYS;
        step.kn = std::min(step.kn, round_up(last, TRIM_KEYS)) - first;
        step.k0 += first;
        bits += first * stride;
        const Scan sc = scan(pb, bits, step.kn, n, used);
        if (!sc.any) return false;
        step.bits = bits;
        step.masked = !sc.all;
        step.all_used = sc.all_used;
        step.seen = sc.seen;
    }
    return true;
}

// K or V rows [k0, k0 + kn) of one head as float32 rows: read in place where they are float32
// and every row is used, else copied into dst (kn x width, row stride ld) with the rows no
// query of the step uses zeroed (NaN there must not leak: 0 * NaN is NaN). Returns the rows and
// sets their stride.
template <typename T>
const float* rows_f32(const T* src, int64_t stride, int64_t kn, int64_t width, const uint8_t* used, float* dst,
                      int64_t ld, int64_t& out_stride) {
    if constexpr (std::is_same_v<T, float>) {
        if (used == nullptr) {
            out_stride = stride;
            return src;
        }
    }
    for (int64_t c = 0; c < kn; ++c) {
        float* d = dst + c * ld;
        if (used != nullptr && !used[c]) {
            std::memset(d, 0, width * sizeof(float));
            continue;
        }
        const T* s = src + c * stride;
        if constexpr (std::is_same_v<T, float>)
            std::memcpy(d, s, width * sizeof(float));
        else
            for (int64_t x = 0; x < width; ++x) d[x] = widen(s[x]);
    }
    out_stride = ld;
    return dst;
}

// softcap * tanh(s * scale / softcap) of raw scores s (Q K^T), the tanh in *th where asked: one function for
// every kernel (forward, backward, statistics, decode), so that they all see the same scores bit for bit.
inline vf capped(const Problem& pb, vf s, vf* th) {
    const vf cap = splat(pb.softcap);
    if (pb.cap_fold) {
        const vf w = s * s;
        vf q = splat(pb.cap_q[4]);
        for (int j = 3; j >= 0; --j) q = q * w + splat(pb.cap_q[j]);
        const vf wq = w * q;
        const vf u = s * splat(pb.scale);
        const vf small = u + u * wq;
        if (!any_not_below(w, splat(pb.cap_w))) {  // (a NaN or infinite score goes on)
            if (th) {
                const vf x = s * splat(pb.cap_mul);
                *th = x + x * wq;
            }
            return small;
        }
        const vf x = s * splat(pb.cap_mul);
        const vf t = tanh_above(x);
        const auto poly = w < splat(pb.cap_w);
        if (th) *th = poly ? x + x * wq : (x != x ? x : t);
        const vf y = poly ? small : cap * t;
        return s != s ? s : y;
    }
    const vf t = vtanh(pb.cap_split ? s * splat(pb.scale) / cap : s * splat(pb.cap_mul));
    if (th) *th = t;
    return cap * t;
}

// The modifications after Q K^T on S^T (kn x SB): the scale, soft-capping (tanh kept in t when
// asked), the band, -inf where hidden. One function (never inlined) for the forward and both
// backward passes: the backward recomputes the forward's scores bit for bit, so a row whose
// weights are 0 or 1 has P exactly 0 or 1 there and the gradients the formula makes 0 are 0.
__attribute__((noinline)) void modify_scores(const Problem& pb, const Step& st, float* s, float* t, const float* band,
                                             int64_t q0) {
    const int64_t n = st.kn * SB;
    if (pb.softcap > 0.0f && t) {
        for (int64_t i = 0; i < n; i += W) {
            vf th;
            store(s + i, capped(pb, load(s + i), &th));
            store(t + i, th);
        }
    } else if (pb.softcap > 0.0f) {
        for (int64_t i = 0; i < n; i += W) store(s + i, capped(pb, load(s + i), nullptr));
    } else {
        const vf mul = splat(pb.scale);
        for (int64_t i = 0; i < n; i += W) store(s + i, load(s + i) * mul);
    }
    if (band) {  // bias(kv - q) for key k0 + c and query q0 + j: band_rev[Lk - 1 - k0 - c + q0 + j]
        for (int64_t c = 0; c < st.kn; ++c) {
            const float* br = band + (pb.Lk - 1 - st.k0 - c + q0);
            for (int j = 0; j < SB; j += W) store(s + c * SB + j, load(s + c * SB + j) + load(br + j));
        }
    }
    if (st.masked) {
        for (int64_t c = 0; c < st.kn; ++c) {
            const uint32_t w = mask_word(st.bits + c * (pb.bq / 8));
            for (int j = 0; j < SB; j += W) {
                vf x = load(s + c * SB + j);
                store(s + c * SB + j, kept(w, j) ? x : splat(NEG_INF));
            }
        }
    }
}

// Q K^T of one step as S^T (kn x SB): K rows (float32, any row stride) times Q^T (D x SB).
__attribute__((noinline)) void scores_f32(const Problem& pb, const Step& st, const float* krows, int64_t kstride,
                                          const float* qt, float* s) {
    gemm<false>(st.kn, SB, pb.D, krows, kstride, 1, qt, SB, s, SB);
}


// Step t of a plan row for the n rows at row_in_block of sequence b, K/V head hk, opened and its
// scores written to s (S^T, kn x SB) as the forward computes them, modifications included; false
// where these rows see none of its keys. The statistics and relevance passes walk the forward's
// steps again with it.
template <typename T>
bool scored_step(const Problem& pb, const PlanRow& plan, int64_t t, int64_t end, int64_t row_in_block, int64_t n,
                 uint8_t* used, const View<const T>& k, int64_t b, int64_t hk, float* kc, const float* qt,
                 const float* band, int64_t r0, float* s, Step& step) {
    if (!open_step(pb, plan, t, end, row_in_block, n, used, step)) return false;
    int64_t kstride;
    const float* krows = rows_f32(k.row(b, hk, step.k0), k.s2, step.kn, pb.D, step.all_used ? nullptr : used, kc,
                                  pb.D, kstride);
    scores_f32(pb, step, krows, kstride, qt, s);
    modify_scores(pb, step, s, nullptr, band, r0);
    return true;
}

// The scores of one step recomputed by the backward as the forward of dtype T computed them (bit for
// bit): float32 products of widened tiles; bf16.h specialises it where bfloat16's forward used
// bfloat16 products. begin() once per 32 rows (qt: Q^T, 2 * ceil(D / 2) rows of SB, past D zero).
template <typename T>
struct StepScores {
    struct State {};
    void begin(State&, const Problem&, const float*) const {}
    void operator()(State&, const Problem& pb, const Step& step, const T* k0, int64_t k_stride, const uint8_t* used,
                    const float* qt, float* kc, float* s) const {
        int64_t kstride;
        const float* krows = rows_f32(k0, k_stride, step.kn, pb.D, used, kc, pb.D, kstride);
        scores_f32(pb, step, krows, kstride, qt, s);
    }
};

// ---- the backward's products of one step ---------------------------------------------------
// dP^T = V dO^T, then dV += P^T dO, dK += dS^T Q and dQ^T += K^T dS^T. StepGrads<T> is what the
// backward calls: float32 products of widened tiles (WidenedGrads); bf16.h specialises it with
// bfloat16 products on AMX tiles (P and dS rounded to bfloat16, float32 sums).
// float32 products of widened tiles. begin() once per 32 rows, with Q rows qr (SB x Dp), dO rows
// dor (SB x Dvp) and dO^T dot (2 * ceil(Dv / 2) rows of SB, past Dv zero), all zero-padded; the
// buffers kc and vc hold bk rows of D and Dv.
template <typename T>
struct WidenedGrads {
    struct State {};
    void begin(State&, const Problem&, const float*, const float*, const float*) const {}

    // dP^T (kn x SB) = V (kn x Dv) dO^T, V read as it is: a hidden pair's dP (NaN where its key's
    // value row is) is never used
    void dp(State&, const Problem& pb, const Step& step, const T* v0, int64_t v_stride, float* vc, const float* dot,
            float* dpt) const {
        int64_t vstride;
        const float* vrows = rows_f32(v0, v_stride, step.kn, pb.Dv, nullptr, vc, pb.Dv, vstride);
        gemm<false>(step.kn, SB, pb.Dv, vrows, vstride, 1, dot, SB, dpt, SB);
    }

    // dV[k0:] += P^T dO, dK[k0:] += dS^T Q (Q rows that see no key of the step zeroed), dQ^T += K^T dS^T;
    // p and ds: P^T and dS^T (kn x SB, the scale applied to dS)
    void grads(State&, const Problem& pb, const Step& step, int64_t, int64_t, const T* k0, int64_t k_stride,
               const uint8_t* used, int64_t n, float* kc, const float* qr, float* qc, const float* dor,
               const float* p, const float* ds, float* dv, float* dk, float* dqt) const {
        int64_t kstride;
        const float* krows = rows_f32(k0, k_stride, step.kn, pb.D, used, kc, pb.D, kstride);
        const float* qrows = qr;
        if (step.seen != first_rows(n)) {
            for (int64_t j = 0; j < SB; ++j) {
                if (j < n && ((step.seen >> j) & 1u))
                    std::memcpy(qc + j * pb.Dp, qr + j * pb.Dp, pb.Dp * sizeof(float));
                else
                    std::memset(qc + j * pb.Dp, 0, pb.Dp * sizeof(float));
            }
            qrows = qc;
        }
        gemm<true>(step.kn, pb.Dvp, SB, p, SB, 1, dor, pb.Dvp, dv + step.k0 * pb.Dvp, pb.Dvp);
        gemm<true>(step.kn, pb.Dp, SB, ds, SB, 1, qrows, pb.Dp, dk + step.k0 * pb.Dp, pb.Dp);
        gemm<true>(pb.D, SB, step.kn, krows, 1, kstride, ds, SB, dqt, SB);
    }
};

template <typename T>
struct StepGrads : WidenedGrads<T> {
    // what the products keep for one call (nothing here; bf16.h: K^T)
    static StepGrads make(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&) { return {}; }
};

struct Item {
    int64_t b, h, qb;  // forward: query head h, row block qb; backward: K/V head h, chunk qb
};

// Runs every item on PyTorch's threads, each thread taking the next item (a dynamic schedule);
// returns the threads' states (for what they summed).
template <typename Work>
std::vector<typename Work::State> run_items(const std::vector<Item>& items, const Work& work) {
    std::atomic<int64_t> next{0};
    const int64_t n = static_cast<int64_t>(items.size());
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
    std::vector<typename Work::State> states(threads);
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
            for (int64_t i = next++; i < n; i = next++) work(items[i], states[t]);
        release_tiles();
    });
    return states;
}

// Runs every item on PyTorch's threads in a static partition by cost: thread t takes the items
// whose share of the summed cost falls in its t-th part, consecutive items, so a call repeated with
// the same items (decoding steps) has each thread read the K/V rows it read the step before, still
// in its own core's cache (a dynamic schedule moved them between cores: one query over 512 keys,
// 8 heads, 2 threads, Intel Xeon, 1.03x -> 0.96x SDPA's time for the kernel).
template <typename Work>
void run_items_static(const std::vector<Item>& items, const std::vector<int64_t>& cost, const Work& work) {
    const int64_t n = static_cast<int64_t>(items.size());
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
    std::vector<int64_t> first(threads + 1, n);  // thread t: items [first[t], first[t + 1])
    int64_t total = 0;
    for (int64_t c : cost) total += c;
    first[0] = 0;
    int64_t before = 0;
    for (int64_t i = 0, t = 1; i < n; ++i) {
        // item i goes to the part holding the middle of its cost
        const int64_t part = total > 0 ? std::min<int64_t>(threads - 1, (2 * before + cost[i]) * threads / (2 * total)) : i * threads / n;
        for (; t <= part; ++t) first[t] = i;
        before += cost[i];
    }
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
        // each thread's buffers kept between calls (a decoding step would allocate them anew)
        static thread_local typename Work::State state;
        for (int64_t t = begin; t < end; ++t)
            for (int64_t i = first[t]; i < first[t + 1]; ++i) work(items[i], state);
        release_tiles();
    });
}

// Items (batch row, query head, row block), the costliest first: threads take them in this
// order (a dynamic schedule), so a causal mask's long last rows do not end the call alone.
std::vector<Item> forward_items(const Problem& pb) {
    std::vector<Item> items;
    std::vector<int64_t> cost;
    for (int64_t b = 0; b < pb.B; ++b)
        for (int64_t h = 0; h < pb.Hq; ++h)
            for (int64_t qb = 0; qb < pb.nq; ++qb) {
                items.push_back({b, h, qb});
                cost.push_back(plan_row(pb, b, h, qb).num);
            }
    std::vector<int64_t> order(items.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return cost[x] > cost[y]; });
    std::vector<Item> sorted;
    for (int64_t i : order) sorted.push_back(items[i]);
    return sorted;
}

std::vector<Item> backward_items(const Problem& pb) {
    std::vector<Item> items;
    for (int64_t c = 0; c < pb.chunks; ++c)
        for (int64_t b = 0; b < pb.B; ++b)
            for (int64_t hk = 0; hk < pb.Hkv; ++hk) items.push_back({b, hk, c});
    return items;
}

}  // namespace
