/* y = op(x Wᵀ + b) for a few rows of x (a decode step of one to a few sequences), on CPU,
 * with W in its plain (N, K) row-major layout, float32 or bfloat16.
 *
 * Why: with one row of x a linear reads each weight once and does two FLOPs with it, so its
 * time is the weight's bytes over the memory bandwidth; the packed GEMMs, built for many rows,
 * reach about half of that bandwidth at one row (docs/benchmarks.md, "Single stream"). Here
 * each thread streams its share of W's rows straight from memory, one row at a time, each
 * against every row of x while it is in L1.
 * bfloat16 weights are widened to float32 in registers (a 16-bit shift), so they cost half
 * the bytes and need no bf16 instructions; sums are float32 either way.
 *
 * Each output is a float32 sum in a fixed order (4 x 8 lanes, then the lanes added): results
 * differ from torch's matmul only in rounding.
 */
#include <stdint.h>

#include "row_dot.h"

#ifndef KVSERVE_SOURCE_SHA256
#define KVSERVE_SOURCE_SHA256 ""
#endif
/* The SHA-256 of this file and the headers beside it as it was built (setup.py, levels.py's
   source_digest): kernels/library.py refuses a library built from another version of them. */
const char *kvserve_source_sha256(void) { return KVSERVE_SOURCE_SHA256; }

/* x (m, k) float32, W (n, k) float32 (bf16 = 0) or bfloat16 (bf16 = 1), bias (n) float32 or
   NULL, other (m, n) float32 for OP_MUL / OP_ADD; y (m, n) float32. Every array contiguous. */
void kvserve_small_linear(const float *x, int64_t m, int64_t k, const void *w, int bf16, int64_t n,
                          const float *bias, int op, const float *other, float *y, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t col = 0; col < n; ++col)
        for (int64_t i0 = 0; i0 < m; i0 += 8) {   /* up to 8 rows of x against this row of W, in L1 */
            const int64_t rows = m - i0 < 8 ? m - i0 : 8;
            float d[8];
            dot_col(x + i0 * k, rows, w, bf16, k, col, d);
            for (int64_t i = i0; i < i0 + rows; ++i) {
                float v = d[i - i0] + (bias ? bias[col] : 0.0f);
                y[i * n + col] = apply(op, v, other ? other[i * n + col] : 0.0f);
            }
        }
}
