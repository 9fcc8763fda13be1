/* Rotary position embedding on CPU, in place, every head of a step's rows in one call:
 * [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] over the two halves of each head (model/rope.py),
 * in float32, or in bfloat16 rounded after each multiply and each sum, as transformers'
 * bfloat16 ops round.
 *
 * Why: as torch ops it is eight per tensor (a chunk, four products, a sum, a difference, a
 * concatenation), 16 per layer for q and k; at one row each op is mostly its call
 * (docs/benchmarks.md, "Single stream").
 */
#include <stdint.h>

#include "bf16.h"
#include "rope_head.h"

#ifndef KVSERVE_SOURCE_SHA256
#define KVSERVE_SOURCE_SHA256 ""
#endif
/* The SHA-256 of this file and the headers beside it as it was built (setup.py, levels.py's
   source_digest): kernels/library.py refuses a library built from another version of them. */
const char *kvserve_source_sha256(void) { return KVSERVE_SOURCE_SHA256; }

#define PARALLEL_FROM 65536   /* elements from which a call uses every thread */

/* Row r's heads start at x + r * row_stride, head h at + h * d (d even); cos and sin (rows, d/2).
   Rows are independent: each is rotated by one thread. */
void kvserve_rope_f32(float *x, int64_t rows, int64_t heads, int64_t d, int64_t row_stride,
                      const float *cos, const float *sin, int threads) {
    int64_t half = d / 2;
    /* a prefill chunk's rows are split between the threads; a decode step's few stay on one */
    #pragma omp parallel for schedule(static) num_threads(rows * heads * d >= PARALLEL_FROM ? threads : 1)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t h = 0; h < heads; ++h)
            rope_head_f32(x + r * row_stride + h * d, cos + r * half, sin + r * half, half);
    }
}

void kvserve_rope_bf16(uint16_t *x, int64_t rows, int64_t heads, int64_t d, int64_t row_stride,
                      const uint16_t *cos, const uint16_t *sin, int threads) {
    int64_t half = d / 2;
    /* a prefill chunk's rows are split between the threads; a decode step's few stay on one */
    #pragma omp parallel for schedule(static) num_threads(rows * heads * d >= PARALLEL_FROM ? threads : 1)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t h = 0; h < heads; ++h)
            rope_head_bf16(x + r * row_stride + h * d, cos + r * half, sin + r * half, half);
    }
}
