// attnkit's native CPU attention kernel: block-sparse flash attention, forward and backward.
//
// Built once per machine by attnkit/kernels/native.py (g++ -O3 -march=native, linked to the
// libtorch that is already loaded, so at::parallel_for shares PyTorch's thread pool) and called
// through ctypes with raw pointers. It walks a PreparedMask's block lists (kv_num, kv_indices and
// the partial blocks' element bits), computes only the blocks a mask keeps, skips the 32-row parts
// of partial blocks that keep nothing, and applies the mask, soft-capping and a bias of kv - q
// (ALiBi, T5's relative bias) inside its tile loop. Everything is float32.
//
// Layout: the scores of one key block against SB query rows are kept key-major, S^T (keys x SB),
// so K and V are read in place as the broadcast operand of one register-blocked micro-kernel and
// the online softmax is vector arithmetic across the SB rows (no horizontal reductions).
//
// Shapes (elements; the last dimension of every input has stride 1):
//   q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), out (B, Hq, Lq, Dv),
//   lse (B, Hq, Lq) float32 contiguous, -inf for a query that sees no key.
// Plan (bq x bk blocks; Bm, Hm are 1 or B, Hq):
//   kv_num (Bm, Hm, nq) int32, kv_idx (Bm, Hm, nq, nk) int32 (kept blocks first),
//   tile_ids (Bm, Hm, nq, nk) int32 (-1: a full block, else a tile of bits_t),
//   bits_t (T, bk, bq / 8) uint8: key-major, bit r % 8 of byte r / 8 of key c's row is query r;
//   1 = may attend.
//
// Equivalent PyTorch code (forward):
//   s = (q @ k.transpose(-2, -1)) * scale; s = softcap * tanh(s / softcap); s = s + bias(kv - q)
//   s = s.masked_fill(~mask, -inf); lse = s.logsumexp(-1); out = softmax(s) @ v  (0 where lse = -inf)

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

namespace {

// ---- vectors: GCC's vector extensions at the machine's native width ------------------------

#if defined(__AVX512F__)
constexpr int W = 16;
constexpr int MR = 8;  // rows of the micro-kernel: MR x (SB / W) accumulators in registers
#elif defined(__AVX__)
constexpr int W = 8;
constexpr int MR = 2;
#elif defined(__ARM_NEON) || defined(__aarch64__)
constexpr int W = 4;
constexpr int MR = 2;
#else
constexpr int W = 4;
constexpr int MR = 1;
#endif

// Query rows computed together against one key block: the tiles of one step fit in L1.
constexpr int SB = 32;
constexpr int NVS = SB / W;  // vectors across SB rows

// Tells the compiler a value lives in a register (so it does not fold a load into each use).
#if defined(__x86_64__)
#define KEEP_IN_REGISTER(x) asm("" : "+x"(x))
#elif defined(__aarch64__)
#define KEEP_IN_REGISTER(x) asm("" : "+w"(x))
#else
#define KEEP_IN_REGISTER(x) (void)0
#endif

typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
// exp() floor of the softmax: weights below exp(-60) of a row's largest are kept at that
// (far below float32's resolution) so no product is subnormal (x86 computes those slowly).
// Hidden pairs are still exactly 0. The same floor as the PyTorch engines (tiles.EXP_FLOOR).
constexpr float EXP_FLOOR = -60.0f;

inline vf load(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof(vf));
    return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }
inline vf splat(float x) {
    vf v = {x};
    return __builtin_shuffle(v, vi{});  // element 0 everywhere: one broadcast instruction
}
// The mask of one key for SB query rows: bit j of a 32-bit word is query row j.
static_assert(SB == 32, "a step's rows are one 32-bit word of mask bits");
inline uint32_t mask_word(const uint8_t* p) {
    uint32_t w;
    std::memcpy(&w, p, 4);  // little-endian: byte 0 holds rows 0-7
    return w;
}
inline vi lane_bits() {  // 1 << lane
    vi v;
    for (int i = 0; i < W; ++i) v[i] = 1 << i;
    return v;
}
inline vi kept(uint32_t word, int j) {  // -1 in the lanes of rows j..j+W-1 whose bit is set
    const vi bits = vi{} + int32_t(word >> j);
    return (bits & lane_bits()) != 0;
}
inline vf vmax(vf x, vf y) { return x > y ? x : y; }

// exp(x) for x in [-87, 88] (callers clamp): Cephes' expf, about 1 ulp.
inline vf vexp(vf x) {
    const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    vf t = x * splat(1.44269504088896341f) + magic;
    vf n = t - magic;
    vf r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    vi e = ((vi)t - (vi)magic) << 23;  // n as an integer, moved into the exponent
    return (vf)((vi)p + e);
}
inline vf vexp_floor(vf x) { return vexp(vmax(x, splat(EXP_FLOOR))); }

// tanh(x): an odd polynomial below 0.625, (1 - e) / (1 + e) with e = exp(-2|x|) above
// (Cephes' tanhf, about 2 ulp).
inline vf vtanh(vf x) {
    vf ax = x < 0 ? -x : x;
    vf z = x * x;
    vf p = splat(-5.70498872745e-3f);
    p = p * z + splat(2.06390887954e-2f);
    p = p * z + splat(-5.37397155531e-2f);
    p = p * z + splat(1.33314422036e-1f);
    p = p * z + splat(-3.33332819422e-1f);
    vf small = x + x * z * p;
    vf e = vexp_floor(splat(-2.0f) * ax);
    vf big = (splat(1.0f) - e) / (splat(1.0f) + e);
    big = x < 0 ? -big : big;
    return ax < splat(0.625f) ? small : big;
}

// ---- the micro-kernel: C[MR x NV*W] (+)= A[MR x K] B[K x NV*W] ----------------------------
// A(i, k) = a[i * ars + k * aks]: any strides, so K, V and transposed tiles are read in place;
// row k of B at b + k * ldb, row i of C at c + i * ldc. With ACC the K products are summed
// from zero and then added to C: a sum over many steps is a sum of per-step sums, whose
// float32 error grows with the number of steps plus K, not with their product.

template <int R, int NV, bool ACC>
inline void micro(int64_t K, const float* a, int64_t ars, int64_t aks, const float* b, int64_t ldb, float* c,
                  int64_t ldc) {
    vf acc[R][NV];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) acc[i][j] = vf{};
    for (int64_t k = 0; k < K; ++k) {
        vf bv[NV];
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) {
            bv[j] = load(b + k * ldb + j * W);
            KEEP_IN_REGISTER(bv[j]);  // one load per k, not one per row
        }
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
            vf av = splat(a[i * ars + k * aks]);
#pragma GCC unroll 16
            for (int j = 0; j < NV; ++j) acc[i][j] += av * bv[j];
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
        for (int j = 0; j < NV; ++j) store(c + i * ldc + j * W, ACC ? load(c + i * ldc + j * W) + acc[i][j] : acc[i][j]);
}

template <int NV, bool ACC>
inline void rows_of(int64_t M, int64_t K, const float* a, int64_t ars, int64_t aks, const float* b, int64_t ldb,
                    float* c, int64_t ldc) {
    int64_t i = 0;
    for (; i + MR <= M; i += MR) micro<MR, NV, ACC>(K, a + i * ars, ars, aks, b, ldb, c + i * ldc, ldc);
    for (; i < M; ++i) micro<1, NV, ACC>(K, a + i * ars, ars, aks, b, ldb, c + i * ldc, ldc);
}

// C[M x N] (+)= A[M x K] B[K x N], N a multiple of W; only rows < M of A are read.
template <bool ACC>
void gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t ars, int64_t aks, const float* b, int64_t ldb,
          float* c, int64_t ldc) {
    int64_t j = 0;
    for (; j + NVS * W <= N; j += NVS * W) rows_of<NVS, ACC>(M, K, a, ars, aks, b + j, ldb, c + j, ldc);
    for (; j < N; j += W) rows_of<1, ACC>(M, K, a, ars, aks, b + j, ldb, c + j, ldc);
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

// ---- the arguments, as ctypes passes them (attnkit/kernels/native.py mirrors this) ----------

extern "C" {

struct AttnArgs {
    int64_t B, Hq, Hkv, Lq, Lk, D, Dv;
    const float* q;
    const float* k;
    const float* v;
    int64_t qs[3], ks[3], vs[3];  // strides of dims 0-2, in elements
    // the plan
    int64_t Bm, Hm, nq, nk, bq, bk;
    const int32_t* kv_num;
    const int32_t* kv_idx;
    const int32_t* tile_ids;
    const uint8_t* bits_t;
    const int64_t* kv_limit;  // (Bl,) or null: keys from kv_limit[b] on are hidden (never read)
    int64_t Bl;
    // score modifications
    float scale;
    float softcap;  // 0: none
    const float* band_rev;  // (band_heads, Lq + Lk - 1 + SB) or null: bias(kv - q) of head h at
    int64_t band_heads;     // band_rev[h, Lk - 1 - kv + q], zero past Lq + Lk - 1
    // forward: out (B, Hq, Lq, Dv) with strides os; lse (B, Hq, Lq) contiguous
    float* out;
    int64_t os[3];
    float* lse;
    // backward: lse as above (input); grad_out and the forward's out with strides gs / ofs;
    // grad_lse (B, Hq, Lq) contiguous or null; dq (B, Hq, Lq, D) contiguous;
    // dk_acc (B, Hkv, chunks, nk * bk, Dp) and dv_acc (..., Dvp) float32 zeros, summed over chunks after
    const float* grad_out;
    int64_t gs[3];
    const float* fwd_out;
    int64_t ofs[3];
    const float* grad_lse;
    float* dq;
    float* dk_acc;
    float* dv_acc;
    int64_t chunks, Dp, Dvp;
    int64_t delta_from_out;  // 1: delta = rowsum(dO O) (a part of the keys: the merged out and lse), else sum of P dP
};

// What the Python side checks before trusting a build: the interface version and the sizes it must pad for.
int attnkit_native_version() { return 4; }
int attnkit_native_rows() { return SB; }
int attnkit_native_width() { return W; }

}  // extern "C"

namespace {

inline int64_t padded(int64_t x) { return round_up(x, W); }

// The part of the call one item needs: its plan row, its keys.
struct PlanRow {
    int64_t num;
    const int32_t* idx;
    const int32_t* tid;
};

struct Call {
    const AttnArgs& a;
    int64_t group;  // Hq / Hkv
    float qmul;     // applied to q: scale, or scale / softcap (the tanh's argument)

    explicit Call(const AttnArgs& args)
        : a(args), group(args.Hq / args.Hkv), qmul(args.softcap > 0.0f ? args.scale / args.softcap : args.scale) {}

    PlanRow plan(int64_t b, int64_t h, int64_t qb) const {
        const int64_t bm = a.Bm == 1 ? 0 : b, hm = a.Hm == 1 ? 0 : h;
        const int64_t at = (bm * a.Hm + hm) * a.nq + qb;
        return {a.kv_num[at], a.kv_idx + at * a.nk, a.tile_ids + at * a.nk};
    }
    int64_t key_end(int64_t b) const { return a.kv_limit ? std::min(a.Lk, a.kv_limit[a.Bl == 1 ? 0 : b]) : a.Lk; }
    const float* krow(int64_t b, int64_t hk, int64_t key) const { return a.k + b * a.ks[0] + hk * a.ks[1] + key * a.ks[2]; }
    const float* vrow(int64_t b, int64_t hk, int64_t key) const { return a.v + b * a.vs[0] + hk * a.vs[1] + key * a.vs[2]; }
    const float* band_of(int64_t h) const {
        return a.band_rev ? a.band_rev + (a.band_heads == 1 ? 0 : h) * (a.Lq + a.Lk - 1 + SB) : nullptr;
    }
};

// Scratch of one thread (aligned to 64 bytes).
struct Buffer {
    std::vector<float> data;
    float* get(size_t n) {
        if (data.size() < n + 16) data.resize(n + 16);
        uintptr_t p = reinterpret_cast<uintptr_t>(data.data());
        return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
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

inline uint32_t first_rows(int64_t n) { return n == 32 ? ~0u : (1u << n) - 1; }

// Scan a partial tile for n <= SB rows: whether any pair is kept, whether all are, which keys
// are used (by some row) and which rows see some key (bit j: row j).
struct Scan {
    bool any, all, all_used;
    uint32_t seen;
};
Scan scan(const AttnArgs& a, const uint8_t* tile, int64_t kn, int64_t n, uint8_t* used) {
    const uint32_t rows = first_rows(n);
    Scan sc{false, true, true, 0};
    for (int64_t c = 0; c < kn; ++c) {
        const uint32_t w = mask_word(tile + c * (a.bq / 8)) & rows;
        used[c] = w != 0;
        sc.seen |= w;
        sc.all &= w == rows;
        sc.all_used &= w != 0;
    }
    sc.any = sc.seen != 0;
    return sc;
}

// Step i of a plan row for the n <= SB rows at row_in_block of its row block, with ``used`` filled
// for a partial block; false when the keys are past the limit or these rows see none of them.
bool open_step(const AttnArgs& a, const int32_t* idx, const int32_t* tid, int64_t i, int64_t end,
               int64_t row_in_block, int64_t n, uint8_t* used, Step& step) {
    step = Step{int64_t(idx[i]) * a.bk, 0, nullptr, false, true, first_rows(n)};
    step.kn = std::min(a.bk, end - step.k0);
    if (step.kn <= 0) return false;
    if (tid[i] >= 0) {
        const uint8_t* bits = a.bits_t + int64_t(tid[i]) * a.bk * (a.bq / 8) + row_in_block / 8;
        const Scan sc = scan(a, bits, step.kn, n, used);
        if (!sc.any) return false;
        step.bits = bits;
        step.masked = !sc.all;
        step.all_used = sc.all_used;
        step.seen = sc.seen;
    }
    return true;
}

// K or V rows [k0, k0 + kn) with the rows no query of the step uses zeroed (NaN there must not
// leak: 0 * NaN is NaN), into dst (kn x width, row stride ld).
const float* clean_rows(const float* src, int64_t stride, int64_t kn, int64_t width, const uint8_t* used, float* dst,
                        int64_t ld) {
    for (int64_t c = 0; c < kn; ++c) {
        float* d = dst + c * ld;
        if (used[c])
            std::memcpy(d, src + c * stride, width * sizeof(float));
        else
            std::memset(d, 0, width * sizeof(float));
    }
    return dst;
}

// Scores S^T (kn x SB) of one step: K rows times the scaled Q^T, soft-capped (tanh kept in t when
// asked), biased, masked with -inf where hidden.
void scores(const Call& call, const Step& st, const float* krows, int64_t kstride, const float* qt, float* s,
            float* t, const float* band, int64_t q0) {
    const AttnArgs& a = call.a;
    gemm<false>(st.kn, SB, a.D, krows, kstride, 1, qt, SB, s, SB);
    if (a.softcap > 0.0f) {
        const vf cap = splat(a.softcap), mul = splat(call.qmul);
        for (int64_t i = 0; i < st.kn * SB; i += W) {
            vf th = vtanh(load(s + i) * mul);
            if (t) store(t + i, th);
            store(s + i, cap * th);
        }
    } else {
        const vf mul = splat(call.qmul);
        for (int64_t i = 0; i < st.kn * SB; i += W) store(s + i, load(s + i) * mul);
    }
    if (band) {  // bias(kv - q) for key k0 + c and query q0 + j: band_rev[Lk - 1 - k0 - c + q0 + j]
        for (int64_t c = 0; c < st.kn; ++c) {
            const float* br = band + (a.Lk - 1 - st.k0 - c + q0);
            for (int j = 0; j < SB; j += W) store(s + c * SB + j, load(s + c * SB + j) + load(br + j));
        }
    }
    if (st.masked) {
        for (int64_t c = 0; c < st.kn; ++c) {
            const uint32_t w = mask_word(st.bits + c * (a.bq / 8));
            for (int j = 0; j < SB; j += W) {
                vf x = load(s + c * SB + j);
                store(s + c * SB + j, kept(w, j) ? x : splat(NEG_INF));
            }
        }
    }
}

struct Item {
    int64_t b, h, qb;  // forward: query head h, row block qb; backward: K/V head h, chunk qb
};

template <typename Work>
void run_items(const std::vector<Item>& items, const Work& work) {
    std::atomic<int64_t> next{0};
    const int64_t n = static_cast<int64_t>(items.size());
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            typename Work::State state;
            for (int64_t i = next++; i < n; i = next++) work(items[i], state);
        }
    });
}

// ---- forward ------------------------------------------------------------------------------

struct Forward {
    const Call& call;
    struct State {
        Buffer qt, s, o, vc;
        std::vector<uint8_t> used;
    };

    void operator()(const Item& it, State& st) const {
        const AttnArgs& a = call.a;
        const int64_t b = it.b, h = it.h, hk = h / call.group;
        const PlanRow plan = call.plan(b, h, it.qb);
        const int64_t end = call.key_end(b);
        const int64_t Dvp = padded(a.Dv);
        const float* band = call.band_of(h);
        float* qt = st.qt.get(a.D * SB);
        float* s = st.s.get(a.bk * SB);
        float* ot = st.o.get(a.Dv * SB);
        float* vc = st.vc.get(a.bk * Dvp);
        st.used.resize(a.bk);
        for (int64_t r0 = it.qb * a.bq; r0 < std::min((it.qb + 1) * a.bq, a.Lq); r0 += SB) {
            const int64_t n = std::min<int64_t>(SB, a.Lq - r0);
            const int64_t row_in_block = r0 - it.qb * a.bq;
            // Q^T (D x SB), scaled; rows past Lq are 0
            for (int64_t j = 0; j < SB; ++j) {
                const float* qr = a.q + b * a.qs[0] + h * a.qs[1] + (r0 + j) * a.qs[2];
                for (int64_t d = 0; d < a.D; ++d) qt[d * SB + j] = j < n ? qr[d] : 0.0f;
            }
            std::fill_n(ot, a.Dv * SB, 0.0f);
            vf m[NVS], l[NVS];
            for (int j = 0; j < NVS; ++j) m[j] = splat(NEG_INF), l[j] = vf{};
            for (int64_t t = 0; t < plan.num; ++t) {
                Step step;
                if (!open_step(a, plan.idx, plan.tid, t, end, row_in_block, n, st.used.data(), step)) continue;
                const float* krows = call.krow(b, hk, step.k0);
                const float* vrows = call.vrow(b, hk, step.k0);
                const int64_t kstride = a.ks[2];
                int64_t vstride = a.vs[2];
                if (!step.all_used) {  // V rows no query of the step uses: zeroed (0 * NaN is NaN)
                    vrows = clean_rows(vrows, vstride, step.kn, a.Dv, st.used.data(), vc, Dvp);
                    vstride = Dvp;
                }
                scores(call, step, krows, kstride, qt, s, nullptr, band, r0);
                // the online softmax across the SB rows
                vf mt[NVS], mn[NVS], ms[NVS], alpha[NVS], sum[NVS];
                for (int j = 0; j < NVS; ++j) mt[j] = splat(NEG_INF), sum[j] = vf{};
                for (int64_t c = 0; c < step.kn; ++c)
                    for (int j = 0; j < NVS; ++j) mt[j] = vmax(mt[j], load(s + c * SB + j * W));
                bool rescale = false;
                for (int j = 0; j < NVS; ++j) {
                    mn[j] = vmax(m[j], mt[j]);
                    ms[j] = mn[j] == splat(NEG_INF) ? vf{} : mn[j];
                    alpha[j] = m[j] == splat(NEG_INF) ? vf{} : vexp_floor(m[j] - mn[j]);
                    for (int i = 0; i < W; ++i) rescale |= mt[j][i] > m[j][i];
                    m[j] = mn[j];
                }
                for (int64_t c = 0; c < step.kn; ++c)
                    for (int j = 0; j < NVS; ++j) {
                        vf x = load(s + c * SB + j * W);
                        vf p = vexp_floor(x - ms[j]);
                        if (step.masked) p = x == splat(NEG_INF) ? vf{} : p;
                        sum[j] += p;
                        store(s + c * SB + j * W, p);
                    }
                for (int j = 0; j < NVS; ++j) l[j] = l[j] * alpha[j] + sum[j];
                if (rescale)
                    for (int64_t d = 0; d < a.Dv; ++d)
                        for (int j = 0; j < NVS; ++j) store(ot + d * SB + j * W, load(ot + d * SB + j * W) * alpha[j]);
                // O^T (Dv x SB) += V^T (Dv x kn) P^T (kn x SB)
                gemm<true>(a.Dv, SB, step.kn, vrows, 1, vstride, s, SB, ot, SB);
            }
            float* lse = a.lse + (b * a.Hq + h) * a.Lq + r0;
            for (int64_t j = 0; j < n; ++j) {
                const float lj = l[j / W][j % W], mj = m[j / W][j % W];
                const float inv = lj > 0.0f ? 1.0f / lj : 0.0f;
                lse[j] = lj > 0.0f ? mj + std::log(lj) : NEG_INF;
                float* dst = a.out + b * a.os[0] + h * a.os[1] + (r0 + j) * a.os[2];
                for (int64_t d = 0; d < a.Dv; ++d) dst[d] = ot[d * SB + j] * inv;
            }
        }
    }
};

// Items (batch row, query head, row block), the costliest first: threads take them in this
// order (a dynamic schedule), so a causal mask's long last rows do not end the call alone.
std::vector<Item> forward_items(const Call& call) {
    const AttnArgs& a = call.a;
    std::vector<Item> items;
    std::vector<int64_t> cost;
    for (int64_t b = 0; b < a.B; ++b)
        for (int64_t h = 0; h < a.Hq; ++h)
            for (int64_t qb = 0; qb < a.nq; ++qb) {
                items.push_back({b, h, qb});
                cost.push_back(call.plan(b, h, qb).num);
            }
    std::vector<int64_t> order(items.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return cost[x] > cost[y]; });
    std::vector<Item> sorted;
    for (int64_t i : order) sorted.push_back(items[i]);
    return sorted;
}

// ---- backward -----------------------------------------------------------------------------
//
// One item is a K/V head of one sequence and a chunk of its row blocks, for every query head of
// its group: dK and dV are summed in the item's own float32 buffer (no two threads write one),
// dQ of each row is complete at the end of its step loop and written once.

struct Backward {
    const Call& call;
    struct State {
        Buffer qt, qr, qc, dot, dor, ot, dqt, kc, vc, ps, dps, ts;
        std::vector<uint8_t> used;
        std::vector<Step> steps;
    };

    void operator()(const Item& it, State& st) const {
        const AttnArgs& a = call.a;
        const int64_t b = it.b, hk = it.h;
        const int64_t Dp = a.Dp, Dvp = a.Dvp;
        const int64_t kv_rows = a.nk * a.bk;
        float* dk = a.dk_acc + ((b * a.Hkv + hk) * a.chunks + it.qb) * kv_rows * Dp;
        float* dv = a.dv_acc + ((b * a.Hkv + hk) * a.chunks + it.qb) * kv_rows * Dvp;
        float* qt = st.qt.get(a.D * SB);     // Q^T scaled (for the scores)
        float* qr = st.qr.get(SB * Dp);      // Q rows, unscaled (for dK)
        float* qc = st.qc.get(SB * Dp);      // the same, rows that see no key of a step zeroed
        float* dot = st.dot.get(a.Dv * SB);  // dO^T (for dP^T)
        float* dor = st.dor.get(SB * Dvp);   // dO rows (for dV)
        float* dqt = st.dqt.get(a.D * SB);   // dQ^T
        float* kc = st.kc.get(a.bk * a.D);
        float* vc = st.vc.get(a.bk * a.Dv);
        st.used.resize(a.bk);
        const int64_t end = call.key_end(b);
        const int64_t qb0 = it.qb * a.nq / a.chunks, qb1 = (it.qb + 1) * a.nq / a.chunks;
        for (int64_t h = hk * call.group; h < (hk + 1) * call.group; ++h) {
            const float* band = call.band_of(h);
            for (int64_t qb = qb0; qb < qb1; ++qb) {
                const PlanRow plan = call.plan(b, h, qb);
                if (plan.num == 0) {  // these queries see no key: their gradient is 0
                    const int64_t q0 = qb * a.bq, q1 = std::min((qb + 1) * a.bq, a.Lq);
                    std::fill_n(a.dq + ((b * a.Hq + h) * a.Lq + q0) * a.D, (q1 - q0) * a.D, 0.0f);
                    continue;
                }
                for (int64_t r0 = qb * a.bq; r0 < std::min((qb + 1) * a.bq, a.Lq); r0 += SB) {
                    step_rows(st, b, h, hk, qb, r0, plan, end, band, qt, qr, qc, dot, dor, dqt, kc, vc, dk, dv);
                }
            }
        }
    }

    void step_rows(State& st, int64_t b, int64_t h, int64_t hk, int64_t qb, int64_t r0, const PlanRow& plan,
                   int64_t end, const float* band, float* qt, float* qr, float* qc, float* dot, float* dor, float* dqt,
                   float* kc, float* vc, float* dk, float* dv) const {
        const AttnArgs& a = call.a;
        const int64_t Dp = a.Dp, Dvp = a.Dvp;
        const int64_t n = std::min<int64_t>(SB, a.Lq - r0);
        const int64_t row_in_block = r0 - qb * a.bq;
        alignas(64) float lse[SB], delta[SB], gl[SB];
        float* ot = st.ot.get(a.Dv * SB);  // the forward's O^T (for delta)
        for (int64_t j = 0; j < SB; ++j) {
            const bool in = j < n;
            const float* q = a.q + b * a.qs[0] + h * a.qs[1] + (r0 + j) * a.qs[2];
            const float* g = a.grad_out + b * a.gs[0] + h * a.gs[1] + (r0 + j) * a.gs[2];
            const float* o = a.fwd_out + b * a.ofs[0] + h * a.ofs[1] + (r0 + j) * a.ofs[2];
            for (int64_t d = 0; d < a.D; ++d) {
                qt[d * SB + j] = in ? q[d] : 0.0f;
                qr[j * Dp + d] = in ? q[d] : 0.0f;
            }
            for (int64_t d = a.D; d < Dp; ++d) qr[j * Dp + d] = 0.0f;
            for (int64_t d = 0; d < a.Dv; ++d) {
                const float gd = in ? g[d] : 0.0f;
                dot[d * SB + j] = gd;
                dor[j * Dvp + d] = gd;
                ot[d * SB + j] = in ? o[d] : 0.0f;
            }
            for (int64_t d = a.Dv; d < Dvp; ++d) dor[j * Dvp + d] = 0.0f;
            const int64_t at = (b * a.Hq + h) * a.Lq + r0 + j;
            const float x = in ? a.lse[at] : NEG_INF;
            lse[j] = x == NEG_INF ? 0.0f : x;  // such a row sees no key: its weights are 0 anyway
            gl[j] = in && a.grad_lse ? a.grad_lse[at] : 0.0f;
        }
        // Pass 1: every step's P^T = exp(S^T - lse) (0 where hidden) and dP^T = V dO^T, kept in this
        // thread's row buffers (O(keys of the row) floats), and delta = sum over keys of P dP - grad_lse:
        // the softmax's own backward, as the naive formula computes it (rowsum(dO O) of the rounded
        // output measured up to 2.5x the naive formula's error on narrow windows). A part of the keys
        // (ring attention) has only the merged output: delta = rowsum(dO O) there.
        const int64_t tile = a.bk * SB;
        float* ps = st.ps.get(plan.num * tile);
        float* dps = st.dps.get(plan.num * tile);
        float* ts = a.softcap > 0.0f ? st.ts.get(plan.num * tile) : nullptr;  // tanh of the scores
        st.steps.assign(plan.num, Step{0, 0, nullptr, false, true, 0});
        vf total[NVS];
        for (int j = 0; j < NVS; ++j) total[j] = vf{};
        for (int64_t i = 0; i < plan.num; ++i) {
            Step step;
            if (!open_step(a, plan.idx, plan.tid, i, end, row_in_block, n, st.used.data(), step)) continue;
            const float* krows = call.krow(b, hk, step.k0);
            const float* vrows = call.vrow(b, hk, step.k0);
            int64_t vstride = a.vs[2];
            if (!step.all_used) {  // V rows no query of the step uses: zeroed (0 * NaN is NaN)
                vrows = clean_rows(vrows, vstride, step.kn, a.Dv, st.used.data(), vc, a.Dv);
                vstride = a.Dv;
            }
            float* si = ps + i * tile;
            float* dpi = dps + i * tile;
            scores(call, step, krows, a.ks[2], qt, si, ts ? ts + i * tile : nullptr, band, r0);
            for (int64_t c = 0; c < step.kn; ++c)
                for (int j = 0; j < SB; j += W) {
                    vf x = load(si + c * SB + j);
                    vf p = vexp_floor(x - load(lse + j));
                    store(si + c * SB + j, step.masked ? (x == splat(NEG_INF) ? vf{} : p) : p);
                }
            gemm<false>(step.kn, SB, a.Dv, vrows, vstride, 1, dot, SB, dpi, SB);  // dP^T (kn x SB)
            if (!a.delta_from_out) {  // this step's sum from zero, then added: a sum of per-step sums
                vf part[NVS];
                for (int j = 0; j < NVS; ++j) part[j] = vf{};
                for (int64_t c = 0; c < step.kn; ++c)
                    for (int j = 0; j < NVS; ++j) part[j] += load(si + c * SB + j * W) * load(dpi + c * SB + j * W);
                for (int j = 0; j < NVS; ++j) total[j] += part[j];
            }
            st.steps[i] = step;
        }
        for (int j = 0; j < NVS; ++j) {
            vf d = total[j];
            if (a.delta_from_out) {  // summed like dP = dO V^T: over one key (O = V) dP - delta is exactly 0
                d = vf{};
                for (int64_t x = 0; x < a.Dv; ++x) d += load(ot + x * SB + j * W) * load(dot + x * SB + j * W);
            }
            store(delta + j * W, d - load(gl + j * W));
        }
        // Pass 2: dS^T = P^T (dP^T - delta), through the tanh, times the scale; dV, dK and dQ
        std::fill_n(dqt, a.D * SB, 0.0f);
        const vf scale = splat(a.scale);
        for (int64_t i = 0; i < plan.num; ++i) {
            const Step& step = st.steps[i];
            if (step.kn == 0) continue;
            const float* krows = call.krow(b, hk, step.k0);
            int64_t kstride = a.ks[2];
            const float* qrows = qr;  // Q rows for dK: rows that see no key of the step zeroed
            if (!step.all_used) {  // K rows no query of the step uses: zeroed (dQ reads them)
                scan(a, step.bits, step.kn, n, st.used.data());
                krows = clean_rows(krows, kstride, step.kn, a.D, st.used.data(), kc, a.D);
                kstride = a.D;
            }
            if (step.seen != first_rows(n)) {
                for (int64_t j = 0; j < SB; ++j) {
                    if (j < n && ((step.seen >> j) & 1u))
                        std::memcpy(qc + j * Dp, qr + j * Dp, Dp * sizeof(float));
                    else
                        std::memset(qc + j * Dp, 0, Dp * sizeof(float));
                }
                qrows = qc;
            }
            const float* pi = ps + i * tile;
            float* dsi = dps + i * tile;
            const float* ti = ts ? ts + i * tile : nullptr;
            for (int64_t c = 0; c < step.kn; ++c)
                for (int j = 0; j < SB; j += W) {
                    const int64_t at = c * SB + j;
                    vf ds = load(pi + at) * (load(dsi + at) - load(delta + j));
                    if (ti) {
                        vf th = load(ti + at);
                        ds = ds * (splat(1.0f) - th * th);
                    }
                    store(dsi + at, ds * scale);
                }
            // dV[k0:] += P^T (kn x SB) dO (SB x Dvp); dK[k0:] += dS^T (kn x SB) Q (SB x Dp)
            gemm<true>(step.kn, Dvp, SB, pi, SB, 1, dor, Dvp, dv + step.k0 * Dvp, Dvp);
            gemm<true>(step.kn, Dp, SB, dsi, SB, 1, qrows, Dp, dk + step.k0 * Dp, Dp);
            // dQ^T (D x SB) += K^T (D x kn) dS^T (kn x SB)
            gemm<true>(a.D, SB, step.kn, krows, 1, kstride, dsi, SB, dqt, SB);
        }
        for (int64_t j = 0; j < n; ++j) {
            float* dst = a.dq + ((b * a.Hq + h) * a.Lq + r0 + j) * a.D;
            for (int64_t d = 0; d < a.D; ++d) dst[d] = dqt[d * SB + j];
        }
    }
};

std::vector<Item> backward_items(const AttnArgs& a) {
    std::vector<Item> items;
    for (int64_t c = 0; c < a.chunks; ++c)
        for (int64_t b = 0; b < a.B; ++b)
            for (int64_t hk = 0; hk < a.Hkv; ++hk) items.push_back({b, hk, c});
    return items;
}

bool valid(const AttnArgs& a) {
    return a.Hkv > 0 && a.Hq % a.Hkv == 0 && a.bq % SB == 0 && a.bq % 8 == 0 && a.bk > 0 && a.D > 0 && a.Dv > 0;
}

}  // namespace

extern "C" int attnkit_native_forward(const AttnArgs* args) {
    if (!valid(*args)) return 1;
    const Call call(*args);
    run_items(forward_items(call), Forward{call});
    return 0;
}

extern "C" int attnkit_native_backward(const AttnArgs* args) {
    if (!valid(*args) || args->chunks < 1 || args->Dp % W != 0 || args->Dvp % W != 0) return 1;
    const Call call(*args);
    run_items(backward_items(*args), Backward{call});
    return 0;
}
