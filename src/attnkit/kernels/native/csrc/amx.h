// attnkit native engine: bfloat16 products on the CPU's matrix units, where the build has them
// (AVX512-BF16 dot products; AMX tiles through PyTorch's oneDNN brgemm). Every #if of the
// bfloat16 path is in this file and bf16.h; release_tiles() is what the float32 code calls.
#pragma once

#include "gemm.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)  // (BW: the 16-bit permutes of bf16.h)
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#define ATTNKIT_BF16_DOT 1
#else
#define ATTNKIT_BF16_DOT 0
#endif

namespace {

#if ATTNKIT_BF16_DOT
// ---- bfloat16 dot products (AVX512-BF16) ----------------------------------------------------
// C[M x N] (+)= A[M x K] B[K x N] with A and B in bfloat16 and float32 sums: vdpbf16ps adds
// a[i, 2p] b[2p, j] + a[i, 2p + 1] b[2p + 1, j] to lane j. A's pairs along K are adjacent in
// memory (row i at a + i * lda, K even: a zero pads an odd K); B is "pair-major" with ldb
// columns: the pair p of column j at b2[(p * ldb + j) * 2] (what pack_pair writes).

typedef __m512bh vbh;

// R rows of C times NV vectors of 16 columns.
template <int R, int NV, bool ACC>
inline void micro_bf16(int64_t pairs, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b2, int64_t ldb,
                       float* c, int64_t ldc) {
    __m512 acc[R][NV];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        vbh bv[NV];
        for (int j = 0; j < NV; ++j) bv[j] = (vbh)_mm512_loadu_si512(b2 + p * 2 * ldb + j * 32);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
            int32_t word;
            std::memcpy(&word, a + i * lda + 2 * p, 4);
            const vbh av = (vbh)_mm512_set1_epi32(word);
            for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, bv[j]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
        float* ci = c + i * ldc;
        for (int j = 0; j < NV; ++j) {
            if (ACC)
                _mm512_storeu_ps(ci + 16 * j, _mm512_add_ps(_mm512_loadu_ps(ci + 16 * j), acc[i][j]));
            else
                _mm512_storeu_ps(ci + 16 * j, acc[i][j]);
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

// C[M x N] (+)= A[M x 2 pairs] B (pair-major, N columns, N a multiple of 16).
template <bool ACC>
void gemm_bf16(int64_t M, int64_t N, int64_t pairs, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b2,
               float* c, int64_t ldc) {
    if (amx_tiles()) {
        at::native::cpublas::brgemm(M, N, 2 * pairs, lda, N, ldc, ACC, a, b2, c, true);
        tiles_configured = true;
        return;
    }
    constexpr int R = 8;
    int64_t j = 0;
    for (; j + 32 <= N; j += 32) {
        int64_t i = 0;
        for (; i + R <= M; i += R) micro_bf16<R, 2, ACC>(pairs, a + i * lda, lda, b2 + 2 * j, N, c + i * ldc + j, ldc);
        for (; i < M; ++i) micro_bf16<1, 2, ACC>(pairs, a + i * lda, lda, b2 + 2 * j, N, c + i * ldc + j, ldc);
    }
    if (j < N) {  // 16 columns left
        int64_t i = 0;
        for (; i + R <= M; i += R) micro_bf16<R, 1, ACC>(pairs, a + i * lda, lda, b2 + 2 * j, N, c + i * ldc + j, ldc);
        for (; i < M; ++i) micro_bf16<1, 1, ACC>(pairs, a + i * lda, lda, b2 + 2 * j, N, c + i * ldc + j, ldc);
    }
}

// C[M x SB] (+)= A[M x 2 pairs] B (pair-major, SB columns).
template <bool ACC>
void gemm_bf16(int64_t M, int64_t pairs, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b2, float* c,
               int64_t ldc) {
    gemm_bf16<ACC>(M, SB, pairs, a, lda, b2, c, ldc);
}

// Two float32 rows of n columns (rows 2p and 2p + 1 of B; n a multiple of 16) as one pair-major
// row of bfloat16: element 2j is x[j], 2j + 1 is y[j] (round to nearest even).
inline void pack_pair(const float* x, const float* y, int64_t n, c10::BFloat16* dst) {
    for (int64_t h = 0; h < n; h += 16) {
        const __m512 lo = _mm512_loadu_ps(x + h), hi = _mm512_loadu_ps(y + h);
        // cvtne2ps: elements 0-15 from the second argument, 16-31 from the first
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // [x0..x15, y0..y15]
        const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                             6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        _mm512_storeu_si512(dst + 2 * h, _mm512_permutexvar_epi16(idx, both));  // [x0, y0, x1, y1, ...]
    }
}

inline void pack_pair(const float* x, const float* y, c10::BFloat16* dst) { pack_pair(x, y, SB, dst); }

// n float32 values (a multiple of 16) as bfloat16 (round to nearest even).
inline void narrow_bf16(const float* x, int64_t n, c10::BFloat16* dst) {
    for (int64_t h = 0; h < n; h += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + h), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + h)));
}
#endif

// n float32 values as T (round to nearest even): bfloat16 16 at a time where the build has
// AVX512-BF16, else one at a time.
template <typename T>
inline void narrow_row(const float* x, int64_t n, T* dst) {
    int64_t i = 0;
#if ATTNKIT_BF16_DOT
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
        i = n / 16 * 16;
        narrow_bf16(x, i, dst);
    }
#endif
    for (; i < n; ++i) dst[i] = narrow<T>(x[i]);
}

// Column j of a tile kept transposed (xt: rows x SB float32) times mul, as one row of T. With
// stream (float32 rows, aligned, whole vectors: see Forward::streams) written past the caches.
template <typename T>
inline void column_as_row(const float* xt, int64_t rows, int64_t j, float mul, T* dst, bool stream = false) {
    alignas(64) float part[64];
    for (int64_t d0 = 0; d0 < rows; d0 += 64) {
        const int64_t m = std::min<int64_t>(64, rows - d0);
        for (int64_t d = 0; d < m; ++d) part[d] = xt[(d0 + d) * SB + j] * mul;
        if constexpr (std::is_same_v<T, float>) {
            if (stream) {
                for (int64_t d = 0; d < m; d += W) store_stream(dst + d0 + d, load(part + d));
                continue;
            }
        }
        narrow_row(part, m, dst + d0);
    }
}

#if ATTNKIT_BF16_DOT
// After a thread's items: hand the AMX tile configuration back (it was set by brgemm).
inline void release_tiles() {
    if (tiles_configured) {
        at::native::cpublas::brgemm_release(true);
        tiles_configured = false;
    }
}
#else
inline void release_tiles() {}
#endif

}  // namespace
