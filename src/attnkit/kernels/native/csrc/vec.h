// attnkit native engine, stage 1: the vector layer. GCC's vector extensions at the machine's
// native width (AVX-512, AVX2, NEON or SSE), exp and tanh as vector code, element types.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__x86_64__)
#include <immintrin.h>
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
// W elements as float32: float32 loaded, bfloat16 widened exactly in the register (its 16 bits
// moved to the top of a float32's 32)
inline vf load_wide(const float* p) { return load(p); }
inline vf load_wide(const c10::BFloat16* p) {
    typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));
    vh h;
    std::memcpy(&h, p, sizeof(vh));
    return (vf)(__builtin_convertvector(h, vi) << 16);
}
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
// Whether any lane of a comparison's result is set: one test instruction on x86 (a loop over the
// lanes compiles to an extract and an OR per lane, which cost as much as the tanh it guards).
inline bool any(vi m) {
#if defined(__AVX512F__)
    const __m512i x = (__m512i)m;
    return _mm512_test_epi32_mask(x, x) != 0;
#elif defined(__AVX__)
    const __m256i x = (__m256i)m;
    return !_mm256_testz_si256(x, x);
#else
    for (int i = 0; i < W; ++i)
        if (m[i]) return true;
    return false;
#endif
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

// Whether a < b fails in any lane (a NaN lane fails): on x86 the compare's own mask, tested once.
inline bool any_not_below(vf a, vf b) {
#if defined(__AVX512F__)
    return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_NLT_UQ) != 0;
#elif defined(__AVX__)
    return _mm256_movemask_ps(_mm256_cmp_ps((__m256)a, (__m256)b, _CMP_NLT_UQ)) != 0;
#else
    for (int i = 0; i < W; ++i)
        if (!(a[i] < b[i])) return true;
    return false;
#endif
}

// Cephes' tanhf: an odd polynomial x + x z P(z), z = x^2, below |x| = 0.625, about 2 ulp;
// TANH_P[j] is the coefficient of z^j in P.
constexpr float TANH_P[5] = {-3.33332819422e-1f, 1.33314422036e-1f, -5.37397155531e-2f, 2.06390887954e-2f,
                             -5.70498872745e-3f};
constexpr float TANH_SMALL = 0.625f;
// ... and (1 - e) / (1 + e) with e = exp(-2|x|) above; NaN stays NaN.
inline vf tanh_above(vf x) {
    vf ax = x < 0 ? -x : x;
    vf e = vexp(splat(-2.0f) * ax);
    vf big = (splat(1.0f) - e) / (splat(1.0f) + e);
    return x < 0 ? -big : big;
}

// tanh(x). A vector whose lanes are all below 0.625 takes the polynomial alone; NaN stays NaN.
inline vf vtanh(vf x) {
    vf z = x * x;
    vf p = splat(TANH_P[4]);
    for (int j = 3; j >= 0; --j) p = p * z + splat(TANH_P[j]);
    vf small = x + x * z * p;
    if (!any_not_below(z, splat(TANH_SMALL * TANH_SMALL))) return small;  // (NaN: goes on)
    vf y = z < splat(TANH_SMALL * TANH_SMALL) ? small : tanh_above(x);
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

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline uint32_t first_rows(int64_t n) { return n == 32 ? ~0u : (1u << n) - 1; }

// A store that bypasses the caches (p aligned to the vector): for output written once and far
// larger than a core's cache, it saves reading each line before writing it. stream_fence() orders
// them before the stores that follow (the end of a thread's items).
inline void store_stream(float* p, vf v) {
#if defined(__AVX512F__)
    _mm512_stream_ps(p, (__m512)v);
#elif defined(__AVX__)
    _mm256_stream_ps(p, (__m256)v);
#else
    store(p, v);
#endif
}
inline void stream_fence() {
#if defined(__x86_64__)
    _mm_sfence();
#endif
}

inline float hsum(vf x) {
    float s = 0.0f;
    for (int i = 0; i < W; ++i) s += x[i];
    return s;
}

}  // namespace
