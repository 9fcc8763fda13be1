/* RMSNorm on CPU, one pass per row: y = weight * round(x / sqrt(mean(x²) + eps)), as
 * transformers computes it (model/layers.py): the normalisation in float32, rounded to the
 * input's dtype before the weight multiplies it; in bfloat16 the product is rounded again.
 *
 * Why: in torch it is five ops (float, pow, mean, rsqrt, two multiplies, a cast) and 17 of them
 * run in every decode step of an 8-layer model; at one row each op is mostly its call
 * (docs/benchmarks.md, "Single stream").
 *
 * The sum of squares is float32 in a fixed order (eight lanes, then added); torch's mean sums in
 * another order, so results differ in the last bits of the scale only.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "rms_row.h"

#ifndef KVSERVE_SOURCE_SHA256
#define KVSERVE_SOURCE_SHA256 ""
#endif
/* The SHA-256 of this file and the headers beside it as it was built (setup.py, levels.py's
   source_digest): kernels/library.py refuses a library built from another version of them. */
const char *kvserve_source_sha256(void) { return KVSERVE_SOURCE_SHA256; }

/* x, y (rows, n) float32 contiguous, weight (n) float32. */
void kvserve_rms_norm_f32(const float *x, const float *weight, float *y, int64_t rows, int64_t n,
                          float eps, int threads) {
    #pragma omp parallel for schedule(static) num_threads(rows > 1 ? threads : 1)
    for (int64_t r = 0; r < rows; ++r)
        rms_row_f32(x + r * n, weight, y + r * n, n, eps);
}

/* x, y (rows, n) bfloat16 contiguous, weight (n) bfloat16. */
void kvserve_rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *y, int64_t rows, int64_t n,
                           float eps, int threads) {
    #pragma omp parallel for schedule(static) num_threads(rows > 1 ? threads : 1)
    for (int64_t r = 0; r < rows; ++r)
        rms_row_bf16(x + r * n, weight, y + r * n, n, eps);
}
