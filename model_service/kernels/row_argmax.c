/* Each row's argmax of float32 logits, on the threads that wrote them.
 *
 * Why: the logits of a decode step are written by every thread of the step's last matmul (the
 * fused step's LM head splits the vocabulary into one contiguous range per thread, as
 * `omp for schedule(static)` does), so one thread reading them all first pulls the other
 * threads' ranges from their cores' caches, which costs far more than the scan itself
 * (docs/benchmarks.md). Here each thread scans the same range the LM head gave it, where it
 * is still in that thread's cache, and the threads' answers are then combined in column order.
 *
 * The answer is torch.argmax's: the first of the largest values, a NaN counting as larger than
 * anything (the first NaN wins), -0.0 equal to +0.0. Values are compared as integers that order
 * like the floats (key()), so -ffast-math's assumptions about NaN and infinities do not apply.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef KVSERVE_SOURCE_SHA256
#define KVSERVE_SOURCE_SHA256 ""
#endif
/* The SHA-256 of this file and the headers beside it as it was built (setup.py, levels.py's
   source_digest): kernels/library.py refuses a library built from another version of them. */
const char *kvserve_source_sha256(void) { return KVSERVE_SOURCE_SHA256; }

/* An unsigned integer in the floats' order; every NaN above +inf, -0.0 the same as +0.0. Written
   without branches, so that the loops below vectorise. */
static inline uint32_t key(float v) {
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    uint32_t magnitude = b & 0x7fffffffu;
    b &= 0u - (uint32_t)(magnitude != 0);                          /* -0.0 -> +0.0 */
    uint32_t k = b ^ ((uint32_t)((int32_t)b >> 31) | 0x80000000u);   /* negative: ~b; else b | sign */
    return k | (0u - (uint32_t)(magnitude > 0x7f800000u));          /* NaN: the largest */
}

enum { BLOCK = 32 };

/* The first column of [lo, hi) of `row` holding its largest key: the largest key of each block
   of BLOCK columns (vectorised), the first block that holds the overall largest, the first
   column in it that does. Every key is above 0 (-inf's is 0x007fffff). */
static int64_t first_max(const float *row, int64_t lo, int64_t hi, uint32_t *best) {
    uint32_t top = 0;
    int64_t from = lo, c = lo;
    for (; c + BLOCK <= hi; c += BLOCK) {
        uint32_t m = 0;
        for (int j = 0; j < BLOCK; j++) {
            uint32_t k = key(row[c + j]);
            m = k > m ? k : m;
        }
        if (m > top) {
            top = m;
            from = c;
        }
    }
    for (; c < hi; c++) {
        uint32_t k = key(row[c]);
        if (k > top) {
            top = k;
            from = c;
        }
    }
    while (key(row[from]) != top)
        from++;
    *best = top;
    return from;
}

/* logits (rows, n) float32 contiguous, n >= 1 -> out (rows,) int64. */
void kvserve_row_argmax(const float *logits, int64_t rows, int64_t n, int32_t threads, int64_t *out) {
    int32_t team = threads < 1 ? 1 : threads;
    if (n < team)
        team = 1;
    uint32_t *keys = malloc(sizeof *keys * rows * team);
    int64_t *cols = malloc(sizeof *cols * rows * team);
    if (keys == NULL || cols == NULL) {   /* no memory for the threads' answers: one thread */
        free(keys);
        free(cols);
        for (int64_t r = 0; r < rows; r++) {
            uint32_t best;
            out[r] = first_max(logits + r * n, 0, n, &best);
        }
        return;
    }
    int32_t used = 1;
#pragma omp parallel num_threads(team)
    {
        /* libgomp's static schedule: n / T columns each, one more for the first n % T threads */
        int64_t t = omp_get_thread_num(), size = omp_get_num_threads();
        int64_t q = n / size, extra = n % size;
        int64_t lo = t * q + (t < extra ? t : extra), hi = lo + q + (t < extra);
        for (int64_t r = 0; r < rows; r++)
            cols[r * team + t] = lo < hi ? first_max(logits + r * n, lo, hi, &keys[r * team + t]) : -1;
#pragma omp single
        used = (int32_t)size;
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t at = -1;
        uint32_t best = 0;
        for (int32_t t = 0; t < used; t++) {   /* column order: a later range wins only if larger */
            int64_t c = cols[r * team + t];
            if (c >= 0 && (at < 0 || keys[r * team + t] > best)) {
                at = c;
                best = keys[r * team + t];
            }
        }
        out[r] = at;
    }
    free(keys);
    free(cols);
}
