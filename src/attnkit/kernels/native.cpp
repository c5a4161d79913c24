// attnkit's native CPU attention engine: block-sparse flash attention, forward and backward,
// registered as PyTorch operators:
//
//   torch.ops.attnkit.native_forward(q, k, v, kv_num, kv_indices, tile_ids, bits, kv_limit, band,
//                                    block_q, block_k, scale, softcap) -> (out, lse)
//   torch.ops.attnkit.native_backward(grad_out, grad_lse, q, k, v, out, lse, <the plan as above>,
//                                     block_q, block_k, scale, softcap, delta_from_out, band_grad)
//                                     -> (dq, dk, dv, dband)
//   torch.ops.attnkit.native_stats(q, k, <the plan>, sinks, qpos, kpos, block_q, block_k, scale, softcap,
//                                  sink_tokens, topk) -> [lse, entropy, max_weight, argmax, sink_mass,
//                                  mean_distance, received, topk_weights, topk_keys]
//
// Built once per machine by attnkit/kernels/native.py (the compiler found on the machine, -O3
// -march=native, against the libtorch that is running: at::parallel_for shares PyTorch's threads)
// and loaded with torch.ops.load_library; the fake (meta) and autograd registrations of the
// forward are in native.py. Every argument is checked here (TORCH_CHECK), so a bad call raises
// a RuntimeError naming the argument instead of reading out of bounds.
//
// It walks a PreparedMask's block lists (kv_num, kv_indices and the partial blocks' element bits),
// computes only the blocks a mask keeps, skips the 32-row parts of partial blocks that keep
// nothing, and applies the mask, soft-capping and a bias of kv - q (ALiBi, T5's relative bias)
// inside its tile loop. Softmax statistics and sums are float32; float32 inputs are read in
// place, bfloat16 and float16 inputs one tile at a time. On CPUs with AVX512-BF16, bfloat16
// inputs take Q K^T and P V as bfloat16 dot products with float32 sums (vdpbf16ps), as PyTorch's
// own CPU flash attention does with its bfloat16 GEMMs; elsewhere their tiles are widened to float32.
//
// A call of at most 8 queries (decoding) takes a row path instead: one dot product per score,
// each key read once for the query heads of its group (see ForwardFew).
//
// Layout: the scores of one key block against SB query rows are kept key-major, S^T (keys x SB),
// so K and V are the broadcast operand of one register-blocked micro-kernel and the online
// softmax is vector arithmetic across the SB rows (no horizontal reductions).
//
// Shapes (elements):
//   q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), out (B, Hq, Lq, Dv) in q's dtype,
//   lse (B, Hq, Lq) float32: -inf for a query that sees no key, NaN where a score it sees is NaN.
// Plan (bq x bk blocks; Bm, Hm are 1 or B, Hq):
//   kv_num (Bm, Hm, nq) int32, kv_indices (Bm, Hm, nq, nk) int32 (kept blocks first),
//   tile_ids (Bm, Hm, nq, nk) int32 (-1: a full block, else a tile of bits),
//   bits (T, bk, bq / 8) uint8: key-major, bit r % 8 of byte r / 8 of key c's row is query r;
//   1 = may attend. kv_limit (Bl,) int64 or None: keys from kv_limit[b] on are hidden (never read).
//   band (Hb, Lq + Lk - 1) float32 or None: bias(kv - q) of head h at band[h, kv - q + Lq - 1].
//
// Equivalent PyTorch code (forward):
//   s = (q @ k.transpose(-2, -1)) * scale; s = softcap * tanh(s / softcap); s = s + bias(kv - q)
//   s = s.masked_fill(~mask, -inf); lse = s.logsumexp(-1); out = softmax(s) @ v  (0 where lse = -inf)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#define ATTNKIT_BF16_DOT 1
#else
#define ATTNKIT_BF16_DOT 0
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

// The interface version native.py checks before it trusts a build (its VERSION).
#define ATTNKIT_NATIVE_INTERFACE 7

namespace {

// ---- vectors: GCC's vector extensions at the machine's native width ------------------------

#if defined(__AVX512F__)
constexpr int W = 16;
constexpr int MR = 8;  // rows of the micro-kernel: MR x (SB / W) accumulators in registers
constexpr const char* ISA = "AVX-512";
#elif defined(__AVX__)
constexpr int W = 8;
constexpr int MR = 2;
constexpr const char* ISA = "AVX2";
#elif defined(__ARM_NEON) || defined(__aarch64__)
constexpr int W = 4;
constexpr int MR = 2;
constexpr const char* ISA = "NEON";
#else
constexpr int W = 4;
constexpr int MR = 1;
constexpr const char* ISA = "SSE/portable";
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
constexpr float NaN = std::numeric_limits<float>::quiet_NaN();
// exp() floor of the softmax: weights below exp(-60) of a row's largest are kept at that
// (far below float32's resolution) so no product is subnormal (x86 computes those slowly).
// A score of -inf (a hidden pair) still weighs exactly 0. The same floor as the PyTorch
// engines (tiles.EXP_FLOOR).
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
// max(a, b) where a NaN in either stays NaN (the formula's max is NaN then; a plain x > y ? x : y
// would drop it and give a finite answer for a row that sees a NaN score).
inline vf vmax_nan(vf a, vf b) { return (b > a) | (b != b) ? b : a; }
inline bool any(vi m) {
    for (int i = 0; i < W; ++i)
        if (m[i]) return true;
    return false;
}

// exp(x): Cephes' expf, about 1 ulp. x is clamped to [EXP_FLOOR, 88]; NaN stays NaN and
// -inf gives exactly 0 (a hidden pair, or a row's max that is -inf).
inline vf vexp(vf x) {
    vf c = x < splat(EXP_FLOOR) ? splat(EXP_FLOOR) : x;  // NaN < f is false: NaN passes through
    c = c > splat(88.0f) ? splat(88.0f) : c;
    const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    vf t = c * splat(1.44269504088896341f) + magic;
    vf n = t - magic;
    vf r = c - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    vi e = ((vi)t - (vi)magic) << 23;  // n as an integer, moved into the exponent
    vf y = (vf)((vi)p + e);
    y = x == splat(NEG_INF) ? vf{} : y;
    return x != x ? x : y;
}

// tanh(x): an odd polynomial below 0.625, (1 - e) / (1 + e) with e = exp(-2|x|) above
// (Cephes' tanhf, about 2 ulp); NaN stays NaN.
inline vf vtanh(vf x) {
    vf ax = x < 0 ? -x : x;
    vf z = x * x;
    vf p = splat(-5.70498872745e-3f);
    p = p * z + splat(2.06390887954e-2f);
    p = p * z + splat(-5.37397155531e-2f);
    p = p * z + splat(1.33314422036e-1f);
    p = p * z + splat(-3.33332819422e-1f);
    vf small = x + x * z * p;
    vf e = vexp(splat(-2.0f) * ax);
    vf big = (splat(1.0f) - e) / (splat(1.0f) + e);
    big = x < 0 ? -big : big;
    vf y = ax < splat(0.625f) ? small : big;
    return x != x ? x : y;
}

// ---- element types -------------------------------------------------------------------------

template <typename T>
inline float widen(T x) {
    return static_cast<float>(x);
}
template <typename T>
inline T narrow(float x) {
    return static_cast<T>(x);  // c10::BFloat16 / c10::Half round to nearest even
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

#if ATTNKIT_BF16_DOT
// ---- bfloat16 dot products (AVX512-BF16) ----------------------------------------------------
// C[M x SB] (+)= A[M x K] B[K x SB] with A and B in bfloat16 and float32 sums: vdpbf16ps adds
// a[i, 2p] b[2p, j] + a[i, 2p + 1] b[2p + 1, j] to lane j. A's pairs along K are adjacent in
// memory (row i at a + i * lda, K even: a zero pads an odd K); B is "pair-major": the pair p of
// column j at b2[(p * SB + j) * 2] (what pack_pairs writes).

typedef __m512bh vbh;

template <int R, bool ACC>
inline void micro_bf16(int64_t pairs, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b2, float* c,
                       int64_t ldc) {
    __m512 acc[R][2];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        const vbh b0 = (vbh)_mm512_loadu_si512(b2 + p * 2 * SB);
        const vbh b1 = (vbh)_mm512_loadu_si512(b2 + p * 2 * SB + 32);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
            int32_t word;
            std::memcpy(&word, a + i * lda + 2 * p, 4);
            const vbh av = (vbh)_mm512_set1_epi32(word);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], av, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], av, b1);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
        float* ci = c + i * ldc;
        if (ACC) {
            _mm512_storeu_ps(ci, _mm512_add_ps(_mm512_loadu_ps(ci), acc[i][0]));
            _mm512_storeu_ps(ci + 16, _mm512_add_ps(_mm512_loadu_ps(ci + 16), acc[i][1]));
        } else {
            _mm512_storeu_ps(ci, acc[i][0]);
            _mm512_storeu_ps(ci + 16, acc[i][1]);
        }
    }
}

// AMX tiles: on CPUs with AMX-BF16 (where oneDNN packs bfloat16 for them: cpublas::could_pack),
// the bfloat16 products go to PyTorch's batch-reduce GEMM (at::native::cpublas::brgemm, oneDNN's
// ukernel, the one PyTorch's CPU flash attention uses); B's pair-major layout is its VNNI layout.
// ATTNKIT_NATIVE_AMX=0 keeps the AVX512-BF16 dot products (to test them on an AMX machine).
bool amx_tiles() {
    static const bool on = [] {
        const char* env = std::getenv("ATTNKIT_NATIVE_AMX");
        if (env != nullptr && std::string(env) == "0") return false;
        return at::native::cpublas::could_pack(at::kBFloat16);
    }();
    return on;
}
thread_local bool tiles_configured = false;  // this thread's tile configuration is set (release it)

// C[M x SB] (+)= A[M x 2 pairs] B (pair-major, SB columns).
template <bool ACC>
void gemm_bf16(int64_t M, int64_t pairs, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b2, float* c,
               int64_t ldc) {
    if (amx_tiles()) {
        at::native::cpublas::brgemm(M, SB, 2 * pairs, lda, SB, ldc, ACC, a, b2, c, true);
        tiles_configured = true;
        return;
    }
    constexpr int R = 8;
    int64_t i = 0;
    for (; i + R <= M; i += R) micro_bf16<R, ACC>(pairs, a + i * lda, lda, b2, c + i * ldc, ldc);
    for (; i < M; ++i) micro_bf16<1, ACC>(pairs, a + i * lda, lda, b2, c + i * ldc, ldc);
}

// Two float32 vectors of SB columns (rows 2p and 2p + 1 of B) as one pair-major row of bfloat16:
// element 2j is x[j], 2j + 1 is y[j] (round to nearest even).
inline void pack_pair(const float* x, const float* y, c10::BFloat16* dst) {
    for (int h = 0; h < SB; h += 16) {
        const __m512 lo = _mm512_loadu_ps(x + h), hi = _mm512_loadu_ps(y + h);
        // cvtne2ps: elements 0-15 from the second argument, 16-31 from the first
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // [x0..x15, y0..y15]
        const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                             6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        _mm512_storeu_si512(dst + 2 * h, _mm512_permutexvar_epi16(idx, both));  // [x0, y0, x1, y1, ...]
    }
}
#endif

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline uint32_t first_rows(int64_t n) { return n == 32 ? ~0u : (1u << n) - 1; }

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

// Step i of a plan row for the n <= SB rows at row_in_block of its row block, with ``used`` filled
// for a partial block; false when the keys are past the limit or these rows see none of them.
bool open_step(const Problem& pb, const PlanRow& plan, int64_t i, int64_t end, int64_t row_in_block, int64_t n,
               uint8_t* used, Step& step) {
    step = Step{int64_t(plan.idx[i]) * pb.bk, 0, nullptr, false, true, first_rows(n)};
    step.kn = std::min(pb.bk, end - step.k0);
    if (step.kn <= 0) return false;
    if (plan.tid[i] >= 0) {
        const uint8_t* bits = pb.bits + int64_t(plan.tid[i]) * pb.bk * (pb.bq / 8) + row_in_block / 8;
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

// The modifications after Q K^T on S^T (kn x SB): the scale, soft-capping (tanh kept in t when
// asked), the band, -inf where hidden. One function (never inlined) for the forward and both
// backward passes: the backward recomputes the forward's scores bit for bit, so a row whose
// weights are 0 or 1 has P exactly 0 or 1 there and the gradients the formula makes 0 are 0.
__attribute__((noinline)) void modify_scores(const Problem& pb, const Step& st, float* s, float* t, const float* band,
                                             int64_t q0) {
    const int64_t n = st.kn * SB;
    if (pb.softcap > 0.0f) {
        const vf cap = splat(pb.softcap);
        if (pb.cap_split) {  // scale / softcap overflows or is subnormal: two roundings, no inf * 0
            const vf scale = splat(pb.scale);
            for (int64_t i = 0; i < n; i += W) {
                vf th = vtanh(load(s + i) * scale / cap);
                if (t) store(t + i, th);
                store(s + i, cap * th);
            }
        } else {
            const vf mul = splat(pb.cap_mul);
            for (int64_t i = 0; i < n; i += W) {
                vf th = vtanh(load(s + i) * mul);
                if (t) store(t + i, th);
                store(s + i, cap * th);
            }
        }
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
        const bool use = used == nullptr || used[c];
        for (int64_t x = 0; x < ld; ++x) d[x] = use && x < width ? src[c * stride + x] : c10::BFloat16(0.0f);
    }
    out_stride = ld;
    return dst;
}

// Q^T (rows x SB float32, rows >= D zero) as pair-major bfloat16 (rows / 2, SB, 2).
void pack_columns(const float* qt, int64_t pairs, c10::BFloat16* q2) {
    for (int64_t p = 0; p < pairs; ++p) pack_pair(qt + 2 * p * SB, qt + (2 * p + 1) * SB, q2 + p * 2 * SB);
}
#endif

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
#if ATTNKIT_BF16_DOT
        if (tiles_configured) {
            at::native::cpublas::brgemm_release(true);
            tiles_configured = false;
        }
#endif
    });
    return states;
}

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
#if ATTNKIT_BF16_DOT
    // step() for the bfloat16 products: S^T (kn x SB) times mul (the scale, when the scores are
    // not yet scaled; mul > 0), its weights written as P^T pair-major bfloat16 (kn/2 pairs, an odd
    // kn padded with a zero row) in the same pass, S left as it was.
    void step_packed(const float* s, int64_t kn, float mul, float* ot, int64_t rows, c10::BFloat16* p2) {
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
#endif
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
#if ATTNKIT_BF16_DOT
        Buffer<c10::BFloat16> q2, p2, v2;
#endif
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
    }

    void finish(const Online& soft, const float* ot, int64_t b, int64_t h, int64_t r0, int64_t n) const {
        float* l = lse + (b * pb.Hq + h) * pb.Lq + r0;
        for (int64_t j = 0; j < n; ++j) {
            l[j] = soft.lse(j);
            const float inv = soft.inverse(j);
            T* dst = out.row(b, h, r0 + j);
            for (int64_t d = 0; d < pb.Dv; ++d) dst[d] = narrow<T>(ot[d * SB + j] * inv);
        }
    }
};

#if ATTNKIT_BF16_DOT
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
    using State = typename Forward<c10::BFloat16>::State;

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
                soft.step_packed(s, step.kn, plain ? pb.scale : 1.0f, ot, pb.Dv, p2);
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
                for (int64_t d = 0; d < pb.Dv; ++d) dst[d] = bf16(ot[d * SB + j] * inv);
            }
        }
    }
};
#endif

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

inline float hsum(vf x) {
    float s = 0.0f;
    for (int i = 0; i < W; ++i) s += x[i];
    return s;
}

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
inline vf row_dots(const float* const* kr, const float* qrow, int64_t Dp) {
    vf acc[W];
#pragma GCC unroll 16
    for (int c = 0; c < W; ++c) acc[c] = vf{};
    for (int64_t x = 0; x < Dp; x += W) {
        const vf qv = load(qrow + x);
#pragma GCC unroll 16
        for (int c = 0; c < W; ++c) acc[c] += qv * load(kr[c] + x);
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

    static void prefetch_row(const T* row, int64_t width) {
        const char* p = reinterpret_cast<const char*>(row);
        for (int64_t x = 0; x < width * int64_t(sizeof(T)); x += 64) __builtin_prefetch(p + x);
    }

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
            const int64_t np = round_up(n, W);
            // S (R x n) = Q K^T, one dot product per score, W keys at a time (W independent sums,
            // folded together at the end)
            for (int64_t c0 = 0; c0 < n; c0 += W) {
                const float* kr[W];
                for (int64_t c = 0; c < W; ++c)
                    kr[c] = c0 + c < n ? padded_row(k.row(b, hk, keys[c0 + c]), pb.D, Dp, kbuf + c * Dp) : zeros;
                // ask for the K rows two groups ahead and this group's V rows (read after the step's
                // scores): one sequence's keys are read once, so the memory's latency would bound it
                for (int64_t c = c0 + 2 * W; c < std::min(n, c0 + 3 * W); ++c) prefetch_row(k.row(b, hk, keys[c]), pb.D);
                for (int64_t c = c0; c < std::min(n, c0 + W); ++c) prefetch_row(v.row(b, hk, keys[c]), pb.Dv);
                for (int64_t r = 0; r < R; ++r) store(s + r * sp + c0, row_dots(kr, qf + r * Dp, Dp));
            }
            for (int64_t r = 0; r < R; ++r) {
                float* sr = s + r * sp;
                const int64_t i = r % Lq;
                // the modifications, in the tile path's order: scale or soft-capping, the band, the mask
                if (pb.softcap > 0.0f) {
                    const vf cap = splat(pb.softcap);
                    for (int64_t c = 0; c < np; c += W) {
                        const vf x = load(sr + c);
                        store(sr + c, cap * vtanh(pb.cap_split ? x * splat(pb.scale) / cap : x * splat(pb.cap_mul)));
                    }
                } else {
                    for (int64_t c = 0; c < np; c += W) store(sr + c, load(sr + c) * splat(pb.scale));
                }
                if (const float* band = pb.band_of(h0 + r / Lq))
                    for (int64_t c = 0; c < n; ++c) sr[c] += band[pb.Lk - 1 - keys[c] + i];
                if (all != 1u)
                    for (int64_t c = 0; c < n; ++c)
                        if (!((bits[c] >> i) & 1u)) sr[c] = NEG_INF;
                for (int64_t c = n; c < np; ++c) sr[c] = NEG_INF;
                // the online softmax of this row over the step
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
            // O (R x Dv) += P V, 4 vectors of a row's O in registers
            for (int64_t u = 0; u < n; ++u)
                vrows[u] = padded_row(v.row(b, hk, keys[u]), pb.Dv, Dvp, vbuf ? vbuf + u * Dvp : nullptr);
            for (int64_t r = 0; r < R; ++r) {
                const float* pr = s + r * sp;
                const uint32_t row = 1u << (r % Lq);
                for (int64_t x0 = 0; x0 < Dvp; x0 += 4 * W) {
                    const int nv = int(std::min<int64_t>(4, (Dvp - x0) / W));
                    vf acc[4] = {vf{}, vf{}, vf{}, vf{}};
                    for (int64_t u = 0; u < n; ++u) {
                        if (!(bits[u] & row)) continue;  // a key this query may not see adds nothing, NaN included
                        const vf p = splat(pr[u]);
                        const float* vr = vrows[u] + x0;
#pragma GCC unroll 4
                        for (int j = 0; j < 4; ++j)
                            if (j < nv) acc[j] += p * load(vr + j * W);
                    }
                    float* orow = o + r * Dvp + x0;
                    for (int j = 0; j < nv; ++j) store(orow + j * W, load(orow + j * W) + acc[j]);
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
            // the scores of step t (S^T, kn x SB), as the forward computes them; false: nothing to see
            auto scores = [&](int64_t t, Step& step) {
                if (!open_step(pb, plan, t, end, row_in_block, n, ws.used.data(), step)) return false;
                int64_t kstride;
                const float* krows = rows_f32(k.row(b, hk, step.k0), k.s2, step.kn, pb.D,
                                              step.all_used ? nullptr : ws.used.data(), kc, pb.D, kstride);
                scores_f32(pb, step, krows, kstride, qt, s);
                modify_scores(pb, step, s, nullptr, band, r0);
                return true;
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
            alignas(64) float lse_row[SB];
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
                if (j >= n) continue;
                const int64_t at = (b * pb.Hq + h) * pb.Lq + r0 + j;
                const float r = lj > 0.0f ? std::exp(lk - lse) : (lj == 0.0f ? 0.0f : NaN);  // the keys' share
                const float inv = lj > 0.0f ? 1.0f / lj : (lj == 0.0f ? 0.0f : NaN);
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
                        const vf d = load(s + c * SB + j * W) - load(lse_row + j * W);
                        const vf w = d > splat(EXP_FLOOR) ? vexp(d) : vf{};  // below exp(-60): 0 (NaN stays NaN)
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
    struct State {
        Buffer<> qt, qr, qc, dot, dor, ot, dqt, kc, vc, ps, dps, ts;
        std::vector<uint8_t> used;
        std::vector<Step> steps;
        std::vector<float> gband;  // the band's gradient, reversed like band_rev (band_grad only)
#if ATTNKIT_BF16_DOT
        Buffer<c10::BFloat16> q2, kb;
#endif
    };
    // bfloat16 inputs recompute the scores with the forward's dot products (bit for bit)
    static constexpr bool BF16_SCORES = ATTNKIT_BF16_DOT && std::is_same_v<T, c10::BFloat16>;

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
        float* dot = st.dot.get(Dv * SB);  // dO^T (for dP^T)
        float* dor = st.dor.get(SB * Dvp); // dO rows (for dV)
        float* dqt = st.dqt.get(D * SB);   // dQ^T
        float* ot = st.ot.get(Dv * SB);    // the forward's O^T (for delta of a part of the keys)
        float* kc = st.kc.get(std::max(pb.bk * D, (W + 1) * Dp));  // (few_scores: W key rows and a zero row)
        float* vc = st.vc.get(pb.bk * Dv);
        alignas(64) float shift[SB], delta[SB], gl[SB];
        std::fill_n(qt + D * SB, (2 * Dpair - D) * SB, 0.0f);
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
#if ATTNKIT_BF16_DOT
        c10::BFloat16* q2 = nullptr;
        c10::BFloat16* kb = nullptr;
        if constexpr (BF16_SCORES) {
            q2 = st.q2.get(Dpair * 2 * SB);
            kb = st.kb.get(pb.bk * 2 * Dpair);
            pack_columns(qt, Dpair, q2);
        }
#endif
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
            int64_t kstride, vstride;
            const float* vrows = rows_f32(v.row(b, hk, step.k0), v.s2, step.kn, Dv, used, vc, Dv, vstride);
            float* si = ps + i * tile;
            float* dpi = dps + i * tile;
            if (pb.Lq <= FEW_ROWS) {  // the row path's scores (its forward ran on these calls)
                few_scores(step, b, hk, used, qr, n, kc, si);
            } else
#if ATTNKIT_BF16_DOT
            if constexpr (BF16_SCORES) {
                const c10::BFloat16* kr = bf16_rows(k.row(b, hk, step.k0), k.s2, step.kn, D, used, kb, kstride);
                scores_bf16(step, Dpair, kr, kstride, q2, si);
            } else
#endif
            {
                const float* krows = rows_f32(k.row(b, hk, step.k0), k.s2, step.kn, D, used, kc, D, kstride);
                scores_f32(pb, step, krows, kstride, qt, si);
            }
            modify_scores(pb, step, si, ts ? ts + i * tile : nullptr, band, r0);
            gemm<false>(step.kn, SB, Dv, vrows, vstride, 1, dot, SB, dpi, SB);  // dP^T (kn x SB)
            vf part_p[NVS], part_pdp[NVS];  // this step's sums from zero, then added: sums of per-step sums
            for (int j = 0; j < NVS; ++j) part_p[j] = part_pdp[j] = vf{};
            for (int64_t c = 0; c < step.kn; ++c)
                for (int j = 0; j < NVS; ++j) {
                    const vf x = load(si + c * SB + j * W);
                    vf p = vexp(x - load(shift + j * W));
                    p = x == splat(NEG_INF) ? vf{} : p;  // hidden: exactly 0, even where the lse is NaN
                    store(si + c * SB + j * W, p);
                    part_p[j] += p;
                    part_pdp[j] += p * load(dpi + c * SB + j * W);
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
            int64_t kstride;
            const float* krows = rows_f32(k.row(b, hk, step.k0), k.s2, step.kn, D, used, kc, D, kstride);
            const float* qrows = qr;  // Q rows for dK: rows that see no key of the step zeroed
            if (step.seen != first_rows(n)) {
                for (int64_t j = 0; j < SB; ++j) {
                    if (j < n && ((step.seen >> j) & 1u))
                        std::memcpy(qc + j * Dp, qr + j * Dp, Dp * sizeof(float));
                    else
                        std::memset(qc + j * Dp, 0, Dp * sizeof(float));
                }
                qrows = qc;
            }
            float* pi = ps + i * tile;
            float* dsi = dps + i * tile;
            const float* ti = ts ? ts + i * tile : nullptr;
            // a hidden pair has P = 0 and no gradient whatever the row holds (its lse or delta may be
            // NaN); a visible pair of a NaN row is NaN, even where its own score is -inf (as the formula's)
            for (int64_t c = 0; c < step.kn; ++c) {
                const uint32_t w = step.masked ? mask_word(step.bits + c * (pb.bq / 8)) : ~0u;
                for (int j = 0; j < SB; j += W) {
                    const int64_t at = c * SB + j;
                    const vi shown = kept(w, j);
                    const vf p = shown ? load(pi + at) * norm[j / W] : vf{};
                    store(pi + at, p);
                    const vf ds = p * (load(dsi + at) - load(delta + j));
                    store(dsi + at, shown ? ds : vf{});
                }
            }
            if (gband) {  // d loss / d bias(kv - q) = dS, summed along the tile's diagonals
                for (int64_t c = 0; c < step.kn; ++c) {
                    float* g = gband + (pb.Lk - 1 - step.k0 - c + r0);
                    for (int j = 0; j < SB; j += W) store(g + j, load(g + j) + load(dsi + c * SB + j));
                }
            }
            for (int64_t c = 0; c < step.kn; ++c)
                for (int j = 0; j < SB; j += W) {
                    const int64_t at = c * SB + j;
                    vf ds = load(dsi + at);
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
            gemm<true>(D, SB, step.kn, krows, 1, kstride, dsi, SB, dqt, SB);
        }
        for (int64_t j = 0; j < n; ++j) {
            T* dst = dq + ((b * pb.Hq + h) * pb.Lq + r0 + j) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = narrow<T>(dqt[d * SB + j]);
        }
    }
};

std::vector<Item> backward_items(const Problem& pb) {
    std::vector<Item> items;
    for (int64_t c = 0; c < pb.chunks; ++c)
        for (int64_t b = 0; b < pb.B; ++b)
            for (int64_t hk = 0; hk < pb.Hkv; ++hk) items.push_back({b, hk, c});
    return items;
}

// ---- the operators: every argument checked, then one parallel run ---------------------------

const char* dtype_name(at::ScalarType t) {  // as torch names them
    switch (t) {
        case at::kFloat: return "torch.float32";
        case at::kBFloat16: return "torch.bfloat16";
        case at::kHalf: return "torch.float16";
        case at::kDouble: return "torch.float64";
        case at::kInt: return "torch.int32";
        case at::kLong: return "torch.int64";
        case at::kByte: return "torch.uint8";
        default: return c10::toString(t);
    }
}

// q/k/v-like: 4-D CPU with the call's dtype; made unit-stride in the last dimension when it is not.
at::Tensor rows_contiguous(const at::Tensor& t, const char* name, at::ScalarType dtype) {
    TORCH_CHECK(t.device().is_cpu(), "attnkit.native: ", name, " must be on the CPU, but is on ", t.device());
    TORCH_CHECK(t.dim() == 4, "attnkit.native: ", name, " must be 4-D (B, H, L, X), but has shape ", t.sizes());
    TORCH_CHECK(t.scalar_type() == dtype, "attnkit.native: ", name, " must be ", dtype_name(dtype), " like q, but is ",
                dtype_name(t.scalar_type()));
    return t.stride(3) == 1 || t.size(3) <= 1 ? t : t.contiguous();
}

at::Tensor index_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape) {
    TORCH_CHECK(t.device().is_cpu(), "attnkit.native: ", name, " must be on the CPU, but is on ", t.device());
    TORCH_CHECK(t.scalar_type() == dtype, "attnkit.native: ", name, " must be ", dtype_name(dtype), ", but is ",
                dtype_name(t.scalar_type()));
    TORCH_CHECK(t.sizes() == shape, "attnkit.native: ", name, " must have shape ", shape, ", but has ", t.sizes());
    return t.contiguous();
}

// The problem of one call, with the plan checked entry by entry (indices in range), and the
// tensors it keeps alive (contiguous copies, the reversed band).
struct Checked {
    Problem pb{};
    at::Tensor q, k, v, kv_num, kv_idx, tile_ids, bits, kv_limit, band_rev;
};

Checked check_call(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& kv_num_,
                   const at::Tensor& kv_idx_, const at::Tensor& tile_ids_, const at::Tensor& bits_,
                   const std::optional<at::Tensor>& kv_limit_, const std::optional<at::Tensor>& band_,
                   int64_t block_q, int64_t block_k, double scale, double softcap) {
    Checked c;
    const at::ScalarType dtype = q_.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                "attnkit.native: q must be float32, bfloat16 or float16, but is ", dtype_name(dtype));
    c.q = rows_contiguous(q_, "q", dtype);
    c.k = rows_contiguous(k_, "k", dtype);
    c.v = rows_contiguous(v_, "v", dtype);
    Problem& pb = c.pb;
    pb.B = c.q.size(0), pb.Hq = c.q.size(1), pb.Lq = c.q.size(2), pb.D = c.q.size(3);
    pb.Hkv = c.k.size(1), pb.Lk = c.k.size(2), pb.Dv = c.v.size(3);
    TORCH_CHECK(c.k.size(0) == pb.B && c.v.size(0) == pb.B, "attnkit.native: q, k and v must have one batch size, got ",
                pb.B, ", ", c.k.size(0), " and ", c.v.size(0));
    TORCH_CHECK(pb.Hkv > 0 && pb.Hq % pb.Hkv == 0 && c.v.size(1) == pb.Hkv,
                "attnkit.native: Hq must be a multiple of Hkv and v must have Hkv heads, but got Hq=", pb.Hq,
                ", k heads ", pb.Hkv, ", v heads ", c.v.size(1));
    TORCH_CHECK(c.v.size(2) == pb.Lk, "attnkit.native: k and v must have one length, got ", pb.Lk, " and ",
                c.v.size(2));
    TORCH_CHECK(c.k.size(3) == pb.D && pb.D > 0 && pb.Dv > 0,
                "attnkit.native: q and k must have one head dim > 0 and v a head dim > 0, got D=", pb.D, ", k's ",
                c.k.size(3), ", Dv=", pb.Dv);
    pb.group = pb.Hq / pb.Hkv;
    TORCH_CHECK(block_q > 0 && block_q % SB == 0 && block_k > 0,
                "attnkit.native: block_q must be a positive multiple of 32 and block_k positive, got (", block_q, ", ",
                block_k, ")");
    pb.bq = block_q, pb.bk = block_k;
    pb.nq = (pb.Lq + block_q - 1) / block_q, pb.nk = (pb.Lk + block_k - 1) / block_k;
    TORCH_CHECK(kv_num_.dim() == 3, "attnkit.native: kv_num must be (Bm, Hm, nq), but has shape ", kv_num_.sizes());
    pb.Bm = kv_num_.size(0), pb.Hm = kv_num_.size(1);
    TORCH_CHECK((pb.Bm == 1 || pb.Bm == pb.B) && (pb.Hm == 1 || pb.Hm == pb.Hq),
                "attnkit.native: the plan's batch and head sizes must be 1 or the inputs' (B=", pb.B, ", Hq=", pb.Hq,
                "), got (", pb.Bm, ", ", pb.Hm, ")");
    c.kv_num = index_tensor(kv_num_, "kv_num", at::kInt, {pb.Bm, pb.Hm, pb.nq});
    c.kv_idx = index_tensor(kv_idx_, "kv_indices", at::kInt, {pb.Bm, pb.Hm, pb.nq, pb.nk});
    c.tile_ids = index_tensor(tile_ids_, "tile_ids", at::kInt, {pb.Bm, pb.Hm, pb.nq, pb.nk});
    TORCH_CHECK(bits_.dim() == 3 && bits_.size(0) >= 1, "attnkit.native: bits must be (T, block_k, block_q / 8), T >= 1, but has shape ",
                bits_.sizes());
    const int64_t tiles = bits_.size(0);
    c.bits = index_tensor(bits_, "bits", at::kByte, {tiles, block_k, block_q / 8});
    // every listed entry in range: a bad plan raises here instead of reading out of bounds
    const int32_t* num = c.kv_num.data_ptr<int32_t>();
    const int32_t* idx = c.kv_idx.data_ptr<int32_t>();
    const int32_t* tid = c.tile_ids.data_ptr<int32_t>();
    for (int64_t r = 0; r < pb.Bm * pb.Hm * pb.nq; ++r) {
        TORCH_CHECK(num[r] >= 0 && num[r] <= pb.nk, "attnkit.native: kv_num holds ", num[r], " at ", r,
                    ", outside [0, ", pb.nk, "]");
        for (int64_t i = 0; i < num[r]; ++i) {
            TORCH_CHECK(idx[r * pb.nk + i] >= 0 && idx[r * pb.nk + i] < pb.nk, "attnkit.native: kv_indices holds ",
                        idx[r * pb.nk + i], ", outside [0, ", pb.nk, ")");
            TORCH_CHECK(tid[r * pb.nk + i] >= -1 && tid[r * pb.nk + i] < tiles, "attnkit.native: tile_ids holds ",
                        tid[r * pb.nk + i], ", outside [-1, ", tiles, ")");
        }
    }
    pb.kv_num = num, pb.kv_idx = idx, pb.tile_ids = tid, pb.bits = c.bits.data_ptr<uint8_t>();
    pb.kv_limit = nullptr, pb.Bl = 0;
    if (kv_limit_.has_value()) {
        TORCH_CHECK(kv_limit_->dim() == 1 && (kv_limit_->size(0) == 1 || kv_limit_->size(0) == pb.B),
                    "attnkit.native: kv_limit must be (1,) or (B,), but has shape ", kv_limit_->sizes());
        c.kv_limit = index_tensor(*kv_limit_, "kv_limit", at::kLong, {kv_limit_->size(0)});
        pb.kv_limit = c.kv_limit.data_ptr<int64_t>(), pb.Bl = c.kv_limit.size(0);
    }
    TORCH_CHECK(std::isfinite(scale), "attnkit.native: scale must be finite, got ", scale);
    TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0, "attnkit.native: softcap must be finite and >= 0 (0: none), got ",
                softcap);
    pb.scale = float(scale), pb.softcap = float(softcap);
    TORCH_CHECK(softcap == 0.0 || pb.softcap > 0.0f, "attnkit.native: softcap ", softcap, " rounds to 0 in float32");
    const float mul = softcap > 0.0 ? float(scale / softcap) : 0.0f;
    pb.cap_mul = mul;
    pb.cap_split = softcap > 0.0 && (!std::isfinite(mul) || (mul != 0.0f && std::fabs(mul) < std::numeric_limits<float>::min()) ||
                                     (mul == 0.0f && scale != 0.0));
    pb.band_rev = nullptr, pb.band_heads = 0;
    if (band_.has_value()) {
        const int64_t width = pb.Lq + pb.Lk - 1;
        TORCH_CHECK(band_->dim() == 2 && (band_->size(0) == 1 || band_->size(0) == pb.Hq) && band_->size(1) == width,
                    "attnkit.native: band must be (1 or Hq, Lq + Lk - 1) = (1 or ", pb.Hq, ", ", width,
                    "), but has shape ", band_->sizes());
        TORCH_CHECK(band_->scalar_type() == at::kFloat && band_->device().is_cpu(),
                    "attnkit.native: band must be float32 on the CPU");
        const at::Tensor band = band_->contiguous();
        pb.band_heads = band.size(0);
        c.band_rev = at::zeros({pb.band_heads, width + SB}, band.options());
        const float* src = band.data_ptr<float>();
        float* dst = c.band_rev.data_ptr<float>();
        for (int64_t h = 0; h < pb.band_heads; ++h)
            for (int64_t i = 0; i < width; ++i) dst[h * (width + SB) + i] = src[h * width + width - 1 - i];
        pb.band_rev = dst;
    }
    return c;
}

#if ATTNKIT_BF16_DOT
// V (B or 1, Hkv, Lk, Dv) bfloat16 as V^T (B or 1, Hkv, Dv, Lk), contiguous (ATen's blocked copy), and
// where the plan has partial tiles finite (B or 1, Hkv, Lk): 1 where a key's value row holds no NaN
// or Inf. The batch once where V is broadcast over it.
void transpose_values(const at::Tensor& v, bool partial, at::Tensor& vt, at::Tensor& finite) {
    const at::Tensor one = v.stride(0) == 0 ? v.narrow(0, 0, 1) : v;
    vt = one.transpose(2, 3).contiguous();
    if (!partial) return;
    const int64_t H = one.size(1), L = one.size(2), Dv = one.size(3);
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
#endif

template <typename T>
void forward_typed(const Checked& c, at::Tensor& out, at::Tensor& lse) {
    const Problem& pb = c.pb;
    View<const T> q = view_of<const T>(c.q), k = view_of<const T>(c.k), v = view_of<const T>(c.v);
    if (pb.Lq <= FEW_ROWS) {
        int64_t heads = 1;
        const std::vector<Item> items = few_items(pb, heads);
        run_items(items, ForwardFew<T>{pb, q, k, v, view_of<T>(out), lse.data_ptr<float>(), heads});
        return;
    }
#if ATTNKIT_BF16_DOT
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
        // with AMX tiles the products are cheap next to transposing V per step: V^T once per call
        at::Tensor vt, finite;
        View<const T> vtv{nullptr, 0, 0, 0};
        if (amx_tiles()) {
            // the finite check only where some listed block is partial (bits always holds one tile)
            const int32_t* tid = c.tile_ids.data_ptr<int32_t>();
            const bool partial = std::any_of(tid, tid + c.tile_ids.numel(), [](int32_t x) { return x >= 0; });
            transpose_values(c.v, partial, vt, finite);
            vtv = view_of<const T>(vt);
            if (vt.size(0) == 1) vtv.s0 = 0;  // V broadcast over the batch
        }
        run_items(forward_items(pb), ForwardBF16{pb, q, k, v, view_of<T>(out), lse.data_ptr<float>(), vtv,
                                                 finite.defined() ? finite.data_ptr<uint8_t>() : nullptr});
        return;
    }
#endif
    run_items(forward_items(pb), Forward<T>{pb, q, k, v, view_of<T>(out), lse.data_ptr<float>()});
}

std::tuple<at::Tensor, at::Tensor> native_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& kv_num, const at::Tensor& kv_indices,
                                                  const at::Tensor& tile_ids, const at::Tensor& bits,
                                                  const std::optional<at::Tensor>& kv_limit,
                                                  const std::optional<at::Tensor>& band, int64_t block_q,
                                                  int64_t block_k, double scale, double softcap) {
    Checked c = check_call(q, k, v, kv_num, kv_indices, tile_ids, bits, kv_limit, band, block_q, block_k, scale, softcap);
    const Problem& pb = c.pb;
    at::Tensor out = at::empty({pb.B, pb.Hq, pb.Lq, pb.Dv}, c.q.options());
    at::Tensor lse = at::empty({pb.B, pb.Hq, pb.Lq}, c.q.options().dtype(at::kFloat));
    if (pb.Lq == 0) return {out, lse};
    switch (c.q.scalar_type()) {
        case at::kFloat: forward_typed<float>(c, out, lse); break;
        case at::kBFloat16: forward_typed<c10::BFloat16>(c, out, lse); break;
        default: forward_typed<c10::Half>(c, out, lse); break;
    }
    return {out, lse};
}

template <typename T>
void backward_typed(Checked& c, const at::Tensor& go, const at::Tensor& of, const at::Tensor& lse,
                    const std::optional<at::Tensor>& gl, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                    at::Tensor& dband) {
    Problem& pb = c.pb;
    const int64_t threads = at::get_num_threads();
    pb.chunks = std::max<int64_t>(1, std::min<int64_t>(pb.nq, (2 * threads + pb.B * pb.Hkv - 1) / (pb.B * pb.Hkv)));
    pb.Dp = round_up(pb.D, W), pb.Dvp = round_up(pb.Dv, W);
    const int64_t rows = pb.nk * pb.bk;
    at::Tensor dk_acc = at::zeros({pb.B, pb.Hkv, pb.chunks, rows, pb.Dp}, c.q.options().dtype(at::kFloat));
    at::Tensor dv_acc = at::zeros({pb.B, pb.Hkv, pb.chunks, rows, pb.Dvp}, c.q.options().dtype(at::kFloat));
    Backward<T> work{pb,
                     view_of<const T>(c.q),
                     view_of<const T>(c.k),
                     view_of<const T>(c.v),
                     view_of<const T>(go),
                     view_of<const T>(of),
                     lse.data_ptr<float>(),
                     gl.has_value() ? gl->data_ptr<float>() : nullptr,
                     dq.data_ptr<T>(),
                     dk_acc.data_ptr<float>(),
                     dv_acc.data_ptr<float>()};
    const auto states = run_items(backward_items(pb), work);
    if (pb.band_grad) {  // the threads' sums, back in the band's own order
        const int64_t width = pb.Lq + pb.Lk - 1;
        float* g = dband.data_ptr<float>();
        for (const auto& state : states) {
            if (state.gband.empty()) continue;
            for (int64_t hb = 0; hb < pb.band_heads; ++hb)
                for (int64_t i = 0; i < width; ++i) g[hb * width + i] += state.gband[hb * (width + SB) + width - 1 - i];
        }
    }
    // dK, dV: the chunks' sums, in the inputs' dtype
    const float* ka = dk_acc.data_ptr<float>();
    const float* va = dv_acc.data_ptr<float>();
    T* dkp = dk.data_ptr<T>();
    T* dvp = dv.data_ptr<T>();
    at::parallel_for(0, pb.B * pb.Hkv, 1, [&](int64_t begin, int64_t end) {
        for (int64_t bh = begin; bh < end; ++bh)
            for (int64_t key = 0; key < pb.Lk; ++key) {
                for (int64_t d = 0; d < pb.D; ++d) {
                    float sum = 0.0f;
                    for (int64_t ch = 0; ch < pb.chunks; ++ch) sum += ka[((bh * pb.chunks + ch) * rows + key) * pb.Dp + d];
                    dkp[(bh * pb.Lk + key) * pb.D + d] = narrow<T>(sum);
                }
                for (int64_t d = 0; d < pb.Dv; ++d) {
                    float sum = 0.0f;
                    for (int64_t ch = 0; ch < pb.chunks; ++ch) sum += va[((bh * pb.chunks + ch) * rows + key) * pb.Dvp + d];
                    dvp[(bh * pb.Lk + key) * pb.Dv + d] = narrow<T>(sum);
                }
            }
    });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> native_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_lse, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& kv_num,
    const at::Tensor& kv_indices, const at::Tensor& tile_ids, const at::Tensor& bits,
    const std::optional<at::Tensor>& kv_limit, const std::optional<at::Tensor>& band, int64_t block_q, int64_t block_k,
    double scale, double softcap, bool delta_from_out, bool band_grad) {
    Checked c = check_call(q, k, v, kv_num, kv_indices, tile_ids, bits, kv_limit, band, block_q, block_k, scale, softcap);
    Problem& pb = c.pb;
    pb.delta_from_out = delta_from_out;
    TORCH_CHECK(!band_grad || band.has_value(), "attnkit.native: band_grad needs a band");
    pb.band_grad = band_grad;
    at::Tensor dband = band_grad ? at::zeros({pb.band_heads, pb.Lq + pb.Lk - 1}, c.q.options().dtype(at::kFloat))
                                 : at::zeros({0}, c.q.options().dtype(at::kFloat));
    const at::ScalarType dtype = c.q.scalar_type();
    const at::Tensor go = rows_contiguous(grad_out, "grad_out", dtype);
    const at::Tensor of = rows_contiguous(out, "out", dtype);
    for (const at::Tensor* t : {&go, &of})
        TORCH_CHECK(t->sizes() == at::IntArrayRef({pb.B, pb.Hq, pb.Lq, pb.Dv}), "attnkit.native: grad_out and out must be (B, Hq, Lq, Dv) = ",
                    at::IntArrayRef({pb.B, pb.Hq, pb.Lq, pb.Dv}), ", but one has shape ", t->sizes());
    const at::Tensor l = index_tensor(lse, "lse", at::kFloat, {pb.B, pb.Hq, pb.Lq});
    std::optional<at::Tensor> gl;
    if (grad_lse.has_value()) gl = index_tensor(*grad_lse, "grad_lse", at::kFloat, {pb.B, pb.Hq, pb.Lq});
    at::Tensor dq = at::empty({pb.B, pb.Hq, pb.Lq, pb.D}, c.q.options());
    at::Tensor dk = at::empty({pb.B, pb.Hkv, pb.Lk, pb.D}, c.q.options());
    at::Tensor dv = at::empty({pb.B, pb.Hkv, pb.Lk, pb.Dv}, c.q.options());
    if (pb.Lq == 0 || pb.Lk == 0) {
        dq.zero_(), dk.zero_(), dv.zero_();
        return {dq, dk, dv, dband};
    }
    switch (dtype) {
        case at::kFloat: backward_typed<float>(c, go, of, l, gl, dq, dk, dv, dband); break;
        case at::kBFloat16: backward_typed<c10::BFloat16>(c, go, of, l, gl, dq, dk, dv, dband); break;
        default: backward_typed<c10::Half>(c, go, of, l, gl, dq, dk, dv, dband); break;
    }
    return {dq, dk, dv, dband};
}

std::vector<at::Tensor> native_stats(const at::Tensor& q, const at::Tensor& k, const at::Tensor& kv_num,
                                     const at::Tensor& kv_indices, const at::Tensor& tile_ids, const at::Tensor& bits,
                                     const std::optional<at::Tensor>& kv_limit, const std::optional<at::Tensor>& band,
                                     const std::optional<at::Tensor>& sinks, const at::Tensor& qpos,
                                     const at::Tensor& kpos, int64_t block_q, int64_t block_k, double scale,
                                     double softcap, int64_t sink_tokens, int64_t topk) {
    Checked c = check_call(q, k, k, kv_num, kv_indices, tile_ids, bits, kv_limit, band, block_q, block_k, scale, softcap);
    const Problem& pb = c.pb;
    TORCH_CHECK(sink_tokens >= 0 && topk >= 0, "attnkit.native: sink_tokens and topk must be >= 0, got ", sink_tokens,
                " and ", topk);
    TORCH_CHECK(pb.Lk <= std::numeric_limits<int32_t>::max(), "attnkit.native: the statistics take at most 2^31 - 1 keys, got ",
                pb.Lk);
    auto positions = [&](const at::Tensor& t, const char* name, int64_t len) {
        TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 &&
                        (t.size(0) == 1 || t.size(0) == pb.B) && t.size(1) == len,
                    "attnkit.native: ", name, " must be float32 (1 or B, ", len, ") on the CPU, but has shape ",
                    t.sizes(), " and dtype ", dtype_name(t.scalar_type()));
        return t.contiguous();
    };
    const at::Tensor qp = positions(qpos, "qpos", pb.Lq), kp = positions(kpos, "kpos", pb.Lk);
    at::Tensor sk;
    if (sinks.has_value()) sk = index_tensor(*sinks, "sinks", at::kFloat, {pb.Hq});
    const auto f32 = c.q.options().dtype(at::kFloat), i64 = c.q.options().dtype(at::kLong);
    auto rows = [&](c10::TensorOptions options) { return at::empty({pb.B, pb.Hq, pb.Lq}, options); };
    at::Tensor lse = rows(f32), entropy = rows(f32), max_weight = rows(f32), sink_mass = rows(f32), distance = rows(f32);
    at::Tensor argmax = rows(i64);
    at::Tensor received = at::zeros({pb.B, pb.Hq, pb.Lk}, f32);
    at::Tensor topk_w = at::zeros({pb.B, pb.Hq, pb.Lq, topk}, f32), topk_i = at::empty({pb.B, pb.Hq, pb.Lq, topk}, i64).fill_(-1);
    if (pb.Lq > 0) {
        Stats st{lse.data_ptr<float>(), entropy.data_ptr<float>(), max_weight.data_ptr<float>(),
                 sink_mass.data_ptr<float>(), distance.data_ptr<float>(), topk_w.data_ptr<float>(),
                 argmax.data_ptr<int64_t>(), topk_i.data_ptr<int64_t>(), qp.data_ptr<float>(), kp.data_ptr<float>(),
                 sk.defined() ? sk.data_ptr<float>() : nullptr, qp.size(0), kp.size(0), sink_tokens, topk};
        auto run = [&](auto tag) {
            using T = decltype(tag);
            const auto states = run_items(forward_items(pb), StatsWork<T>{pb, view_of<const T>(c.q), view_of<const T>(c.k), st});
            float* out = received.data_ptr<float>();
            at::parallel_for(0, pb.B * pb.Hq * pb.Lk, 4096, [&](int64_t begin, int64_t end) {
                for (const auto& state : states)
                    if (!state.received.empty())
                        for (int64_t i = begin; i < end; ++i) out[i] += state.received[i];
            });
        };
        switch (c.q.scalar_type()) {
            case at::kFloat: run(float{}); break;
            case at::kBFloat16: run(c10::BFloat16{}); break;
            default: run(c10::Half{}); break;
        }
    }
    return {lse, entropy, max_weight, argmax, sink_mass, distance, received, topk_w, topk_i};
}

std::string native_info() {
    std::string words = std::string(ISA) + " (" + std::to_string(W) + " floats a vector)";
#if ATTNKIT_BF16_DOT
    words += amx_tiles() ? "; bfloat16: AMX tiles (oneDNN brgemm)" : "; bfloat16: AVX512-BF16 dot products";
#else
    words += "; bfloat16: widened to float32";
#endif
    return words;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnkit, m) {
    m.set_python_module("attnkit.kernels.native_build");  // the fake and autograd registrations
    m.def(
        "native_forward(Tensor q, Tensor k, Tensor v, Tensor kv_num, Tensor kv_indices, Tensor tile_ids, "
        "Tensor bits, Tensor? kv_limit, Tensor? band, int block_q, int block_k, float scale, float softcap) "
        "-> (Tensor, Tensor)");
    m.def(
        "native_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor kv_num, Tensor kv_indices, Tensor tile_ids, Tensor bits, Tensor? kv_limit, Tensor? band, "
        "int block_q, int block_k, float scale, float softcap, bool delta_from_out, bool band_grad) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
    m.def(
        "native_stats(Tensor q, Tensor k, Tensor kv_num, Tensor kv_indices, Tensor tile_ids, Tensor bits, "
        "Tensor? kv_limit, Tensor? band, Tensor? sinks, Tensor qpos, Tensor kpos, int block_q, int block_k, "
        "float scale, float softcap, int sink_tokens, int topk) -> Tensor[]");
    m.def("native_interface() -> int", []() -> int64_t { return ATTNKIT_NATIVE_INTERFACE; });
    m.def("native_info() -> str", []() -> std::string { return native_info(); });
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
    m.impl("native_forward", &native_forward);
    m.impl("native_backward", &native_backward);
    m.impl("native_stats", &native_stats);
}
