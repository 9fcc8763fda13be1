/* One output of a small-batch linear: x · W[row] (W float32 or bfloat16, streamed one row at a
 * time) and the element-wise op of its epilogue. Shared by small_linear.c and decode_layer.c
 * (included, never built alone); why one row at a time: small_linear.c. */
#ifndef KVSERVE_ROW_DOT_H
#define KVSERVE_ROW_DOT_H
#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "bf16.h"

enum { OP_NONE = 0, OP_SILU = 1, OP_MUL = 2, OP_ADD = 3 };

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* x · W[row]: W float32 (bf16 = 0) or bfloat16. One row at a time, so each thread reads
   its weights as one sequential stream (four rows at a time, interleaved, measured ~40 %
   slower: the prefetchers follow one stream per core best). */
static float dot_row(const float *x, const void *w, int bf16, int64_t k, int64_t row) {
    const float *wf = (const float *)w + row * k;
    const uint16_t *wh = (const uint16_t *)w + row * k;
    int64_t j = 0;
    float s = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    if (bf16) {
        for (; j + 32 <= k; j += 32) {
            a0 = _mm256_fmadd_ps(load8_bf16(wh + j), load8(x + j), a0);
            a1 = _mm256_fmadd_ps(load8_bf16(wh + j + 8), load8(x + j + 8), a1);
            a2 = _mm256_fmadd_ps(load8_bf16(wh + j + 16), load8(x + j + 16), a2);
            a3 = _mm256_fmadd_ps(load8_bf16(wh + j + 24), load8(x + j + 24), a3);
        }
        for (; j + 8 <= k; j += 8)
            a0 = _mm256_fmadd_ps(load8_bf16(wh + j), load8(x + j), a0);
    } else {
        for (; j + 32 <= k; j += 32) {
            a0 = _mm256_fmadd_ps(load8(wf + j), load8(x + j), a0);
            a1 = _mm256_fmadd_ps(load8(wf + j + 8), load8(x + j + 8), a1);
            a2 = _mm256_fmadd_ps(load8(wf + j + 16), load8(x + j + 16), a2);
            a3 = _mm256_fmadd_ps(load8(wf + j + 24), load8(x + j + 24), a3);
        }
        for (; j + 8 <= k; j += 8)
            a0 = _mm256_fmadd_ps(load8(wf + j), load8(x + j), a0);
    }
    s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    for (; j < k; ++j)
        s += x[j] * (bf16 ? bf16_to_f32(wh[j]) : wf[j]);
    return s;
}

static inline float apply(int op, float v, float other) {
    switch (op) {
    case OP_SILU: {
        float t = v < -80.0f ? -80.0f : v;   /* no inf from expf: the build is -ffast-math */
        return v / (1.0f + expf(-t));
    }
    case OP_MUL: return v * other;
    case OP_ADD: return v + other;
    default: return v;
    }
}

#endif
