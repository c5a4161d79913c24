// attnkit native engine, stage 2: the float32 micro-kernel and GEMM every product of the engine uses.
#pragma once

#include "vec.h"

namespace {

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

}  // namespace
