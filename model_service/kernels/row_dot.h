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
/* How far ahead of its loads a row's stream asks for weights, in bytes: the hardware prefetchers
   alone left one core's stream well under the memory's bandwidth. The distances are an AMD Zen 3's
   best and within a few per cent of an Intel Ice Lake's, whose best, 4 KiB, made Zen 3's float32
   step markedly slower (docs/benchmarks.md, "prefetch distance").
   Rows are read one after another, so past a row's end this asks for the next one's start; a
   prefetch never faults, past the weights' end included. */
#define PREFETCH_AHEAD_F32 1024
#define PREFETCH_AHEAD_BF16 2048

static inline void prefetch_w(const float *wf, const uint16_t *wh, int64_t j, int bf16, int bytes) {
    const char *at = bf16 ? (const char *)(wh + j) + PREFETCH_AHEAD_BF16 : (const char *)(wf + j) + PREFETCH_AHEAD_F32;
    for (int line = 0; line < bytes; line += 64)
        _mm_prefetch(at + line, _MM_HINT_T0);
}

static inline __m256 load8(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
/* 8 weights from element j: of the float32 row or, with bf16, of the bfloat16 one, widened */
static inline __m256 load8_w(const float *wf, const uint16_t *wh, int64_t j, int bf16) {
    return bf16 ? load8_bf16(wh + j) : load8(wf + j);
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
   slower: the prefetchers follow one stream per core best), that stream prefetched ahead.
   (Rows of several x at once, dot_rows_m, gained nothing from prefetching: their loads bound
   them. 16 lanes a load with AVX-512 gained nothing over 8 once prefetched.) */
static float dot_row(const float *x, const void *w, int bf16, int64_t k, int64_t row) {
    const float *wf = (const float *)w + row * k;
    const uint16_t *wh = (const uint16_t *)w + row * k;
    int64_t j = 0;
    float s = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; j + 32 <= k; j += 32) {
        prefetch_w(wf, wh, j, bf16, bf16 ? 64 : 128);
        a0 = _mm256_fmadd_ps(load8_w(wf, wh, j, bf16), load8(x + j), a0);
        a1 = _mm256_fmadd_ps(load8_w(wf, wh, j + 8, bf16), load8(x + j + 8), a1);
        a2 = _mm256_fmadd_ps(load8_w(wf, wh, j + 16, bf16), load8(x + j + 16), a2);
        a3 = _mm256_fmadd_ps(load8_w(wf, wh, j + 24, bf16), load8(x + j + 24), a3);
    }
    for (; j + 8 <= k; j += 8)
        a0 = _mm256_fmadd_ps(load8_w(wf, wh, j, bf16), load8(x + j), a0);
    s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    for (; j < k; ++j)
        s += x[j] * (bf16 ? bf16_to_f32(wh[j]) : wf[j]);
    return s;
}

/* x[i] · W[row] for the m rows of x (row i at x + i * k), 2 <= M <= 8 a constant in each
   inlined copy: each chunk of the weight row is loaded once and multiplied into every row's
   accumulator, where dot_row per row of x would load it m times (at a few rows the loads, not
   the bytes from memory, bound the small-batch linear; docs/benchmarks.md). Two accumulators
   per row of x up to four rows, one beyond (every accumulator in a register). */
static inline __attribute__((always_inline)) void
dot_rows_m(const float *x, const void *w, int bf16, int64_t k, int64_t row, float *out, const int M) {
    const float *wf = (const float *)w + row * k;
    const uint16_t *wh = (const uint16_t *)w + row * k;
    int64_t j = 0;
    float s[8] = {0};
#if defined(__AVX2__) && defined(__FMA__)
    __m256 a[8], b[8];
    for (int i = 0; i < M; i++)
        a[i] = b[i] = _mm256_setzero_ps();
    if (M <= 4) {
        for (; j + 16 <= k; j += 16) {
            __m256 w0 = load8_w(wf, wh, j, bf16);
            __m256 w1 = load8_w(wf, wh, j + 8, bf16);
            for (int i = 0; i < M; i++) {
                a[i] = _mm256_fmadd_ps(w0, load8(x + i * k + j), a[i]);
                b[i] = _mm256_fmadd_ps(w1, load8(x + i * k + j + 8), b[i]);
            }
        }
    }
    for (; j + 8 <= k; j += 8) {
        __m256 w0 = load8_w(wf, wh, j, bf16);
        for (int i = 0; i < M; i++)
            a[i] = _mm256_fmadd_ps(w0, load8(x + i * k + j), a[i]);
    }
    for (int i = 0; i < M; i++)
        s[i] = hsum(M <= 4 ? _mm256_add_ps(a[i], b[i]) : a[i]);
#endif
    for (; j < k; ++j) {
        float wj = bf16 ? bf16_to_f32(wh[j]) : wf[j];
        for (int i = 0; i < M; i++)
            s[i] += x[i * k + j] * wj;
    }
    for (int i = 0; i < M; i++)
        out[i] = s[i];
}

/* out[i] = x[i] · W[row] for every row i < m of x (rows k apart), 1 <= m <= 8: one row as
   dot_row, 2-8 at once as dot_rows_m. */
static inline void dot_col(const float *x, int64_t m, const void *w, int bf16, int64_t k, int64_t row, float *out) {
    switch (m) {
    case 1: out[0] = dot_row(x, w, bf16, k, row); break;
    case 2: dot_rows_m(x, w, bf16, k, row, out, 2); break;
    case 3: dot_rows_m(x, w, bf16, k, row, out, 3); break;
    case 4: dot_rows_m(x, w, bf16, k, row, out, 4); break;
    case 5: dot_rows_m(x, w, bf16, k, row, out, 5); break;
    case 6: dot_rows_m(x, w, bf16, k, row, out, 6); break;
    case 7: dot_rows_m(x, w, bf16, k, row, out, 7); break;
    case 8: dot_rows_m(x, w, bf16, k, row, out, 8); break;
    default: break;
    }
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
