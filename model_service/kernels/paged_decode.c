/* Paged decode attention on CPU, float32 or bfloat16: one query token per sequence; and, for
 * prefill, a prompt chunk's causal attention (kvserve_causal_attention_f32, below).
 *
 * Built when kvserve is installed (setup.py; levels and flags in kernels/levels.py)
 * and run on torch's own OpenMP pool (kernels/library.py). The torch backend
 * gathers a decode group's pages into a buffer and runs SDPA over it, reading
 * every key and value twice and writing them once; here each page is read once,
 * straight from the cache, with an online softmax.
 *
 * Layout (model_service/attention/base.py):
 *   q, out              (num_seqs, num_heads, head_dim)
 *   k_cache, v_cache    (num_pages, page_size, num_kv_heads, head_dim)
 *   tables              (num_seqs, table_stride) page ids, int32
 *   seq_lens            (num_seqs,) keys to attend, int32, >= 1
 * Query head h reads KV head h / (num_heads / num_kv_heads) (GQA).
 * In bfloat16 (q, caches and out), keys and values are widened to float32 as they are read,
 * every sum is float32, and the output is rounded once, as torch's SDPA does on CPU. A float32
 * model's caches may be bfloat16 (--kv-cache-dtype): q and out float32, pages widened as read.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "attend.h"

#ifndef KVSERVE_SOURCE_SHA256
#define KVSERVE_SOURCE_SHA256 ""
#endif
/* The SHA-256 of this file and the headers beside it as it was built (setup.py, levels.py's
   source_digest): kernels/library.py refuses a library built from another version of them. */
const char *kvserve_source_sha256(void) { return KVSERVE_SOURCE_SHA256; }

/* q16: q and out bfloat16 (else float32); kv16: the caches bfloat16 (else float32); q16 implies kv16. */
void kvserve_paged_decode(const void *q, const void *k_cache, const void *v_cache,
                          const int32_t *tables, int64_t table_stride,
                          const int32_t *seq_lens, void *out, int64_t num_seqs,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t page_size, float scale, int32_t q16, int32_t kv16, int32_t num_threads)
{
    /* Tasks as attend_parts() shares them out; dynamic scheduling evens out sequences of
     * different lengths. */
    const attend_fn attend_one = pick_attend(q16, kv16, head_dim);
    int64_t per_part;
    const int64_t parts = attend_parts(num_seqs, num_kv_heads, num_threads, &per_part);
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t task = 0; task < num_seqs * parts; task++) {
        const int64_t s = task / parts, first = task % parts * per_part;
        const int64_t count = num_kv_heads - first < per_part ? num_kv_heads - first : per_part;
        const int64_t at = s * num_heads * head_dim * (q16 ? 2 : 4);   /* bytes */
        attend_one((const char *)q + at, k_cache, v_cache, tables + s * table_stride,
                   seq_lens[s], (char *)out + at, num_heads, num_kv_heads,
                   head_dim, page_size, scale, first, count);
    }
}

/* The softmax of a chunk of queries behind a cached prefix, for the cpu backend's
 * matmul path (scores = Q Kᵀ by the native GEMM or oneDNN, then this, then P V), in place:
 *   scores   (rows, cols), rows = the query heads of one KV head x `chunk` queries
 *            (row r is query r % chunk), cols = cached + chunk keys
 * Row r becomes softmax(scale * scores) over its first cached + r % chunk + 1 keys
 * (causal within the chunk) and 0 beyond. One pass where torch takes three (scale,
 * mask, softmax); its exp is the vectorised one -ffast-math allows. */
void kvserve_chunk_softmax_f32(float *scores, int64_t rows, int64_t cols, int64_t chunk,
                               int64_t cached, float scale, int32_t num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        float *s = scores + r * cols;
        const int64_t n = cached + r % chunk + 1;
        float top = -FLT_MAX, sum = 0.0f;
        for (int64_t j = 0; j < n; j++)
            top = fmaxf(top, s[j]);
        for (int64_t j = 0; j < n; j++) {
            s[j] = expf((s[j] - top) * scale);   /* scale > 0: the largest scaled score is scale * top */
            sum += s[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < n; j++)
            s[j] *= inv;
        for (int64_t j = n; j < cols; j++)
            s[j] = 0.0f;
    }
}

#define CAUSAL_MAX_HEAD_DIM 512   /* kernels/paged_decode.py's CAUSAL_MAX_HEAD_DIM */

#if defined(__AVX512F__)
/* e^x for 16 floats, inline: 2^(x log2 e) split into 2^k (scalef) and 2^f, |f| <= 1/2, the latter
 * by its Taylor series to degree 7 (relative error ~1e-8, under float32's rounding). x below
 * -100 gives 0 (as good as e^-100 beside the row's largest term, which is 1). */
static inline __m512 exp16(__m512 x)
{
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.44269504088896341f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, k), _mm512_set1_ps(0.693147180559945309f));   /* f ln 2 */
    __m512 p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, k);
}

/* A prompt chunk's causal attention, float32, head_dim a multiple of 16 (64 and 128 constants in
 * inlined copies of their own): L queries at absolute positions cached .. cached + L - 1 over
 * S = cached + L keys, query i seeing keys 0 .. cached + i. Flash attention's loop on the CPU: one task per query head and
 * block of 16 queries; per block of 16 keys, the 16 x 16 scores as 16 vectors (one per query, a
 * lane per key) by outer products over d with the keys transposed, an online softmax per query,
 * and the values summed into the queries' float32 accumulators. Every key is read from the
 * transposed copy kt (num_kv_heads, head_dim, S rounded up to 16) the first phase writes. */
static inline __attribute__((always_inline)) void
causal_block(const float *q, int64_t q_stride, const float *v, int64_t kv_stride, float *out,
             int64_t out_stride, int64_t L, int64_t cached, int64_t num_heads, int64_t num_kv_heads,
             const int64_t D, float scale, const float *kt, int64_t S16, int64_t h, int64_t r0)
{
    enum { B = 16 };
    const int64_t NV = D / 16;
    const int64_t kh = h / (num_heads / num_kv_heads);
    const int64_t n = L - r0 < B ? L - r0 : B;
    float qs[B][D] __attribute__((aligned(64)));
    float acc[B][D] __attribute__((aligned(64)));
    float probs[B][B] __attribute__((aligned(64)));
    float top[B], denom[B];
    for (int64_t i = 0; i < B; i++) {
        top[i] = -FLT_MAX;
        denom[i] = 0.f;
        for (int64_t t = 0; t < B; t++)
            probs[i][t] = 0.f;   /* rows past n stay 0: the value sums take whole groups of rows */
        for (int64_t d = 0; d < D; d++) {
            qs[i][d] = i < n ? q[(r0 + i) * q_stride + h * D + d] * scale : 0.f;
            acc[i][d] = 0.f;
        }
    }
    const float *kh_t = kt + kh * D * S16;
    const int64_t last = cached + r0 + n;   /* keys the block's last query sees */
    for (int64_t c0 = 0; c0 < last; c0 += B) {
        __m512 s[B];
        for (int64_t i = 0; i < B; i++)
            s[i] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            const __m512 keys = _mm512_loadu_ps(kh_t + d * S16 + c0);
            for (int64_t i = 0; i < B; i++)
                s[i] = _mm512_fmadd_ps(_mm512_set1_ps(qs[i][d]), keys, s[i]);
        }
        int64_t widest = 0;   /* keys of this block any query sees */
        for (int64_t i = 0; i < n; i++) {
            int64_t seen = cached + r0 + i + 1 - c0;   /* query i sees keys c0 .. c0 + seen - 1 */
            seen = seen > B ? B : seen;
            if (seen <= 0) {
                for (int64_t t = 0; t < B; t++)
                    probs[i][t] = 0.f;
                continue;
            }
            widest = seen > widest ? seen : widest;
            const __mmask16 live = (__mmask16)((1u << seen) - 1);
            const float m = _mm512_mask_reduce_max_ps(live, s[i]);
            const float m_new = m > top[i] ? m : top[i];
            const float correction = expf(top[i] - m_new);
            top[i] = m_new;
            const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s[i], _mm512_set1_ps(m_new))));
            _mm512_store_ps(probs[i], e);   /* 0 for keys it does not see */
            denom[i] = denom[i] * correction + _mm512_reduce_add_ps(e);
            if (correction != 1.f)
                for (int64_t j = 0; j < NV; j++)
                    _mm512_store_ps(&acc[i][16 * j], _mm512_mul_ps(_mm512_load_ps(&acc[i][16 * j]),
                                                                   _mm512_set1_ps(correction)));
        }
        /* The values, R queries at a time sharing each value vector loaded (R x NV accumulators:
           16 registers up to head_dim 256); rows past n add zeros (their probabilities are 0). */
        const float *vb = v + c0 * kv_stride + kh * D;
        int64_t R = 1;   /* a power of two, so that groups of R tile the 16 rows */
        while (2 * R * NV <= 16)
            R *= 2;
        for (int64_t i0 = 0; i0 < n; i0 += R) {
            __m512 a[CAUSAL_MAX_HEAD_DIM / 16];   /* R x NV <= max(16, NV) */
            for (int64_t r = 0; r < R; r++)
                for (int64_t j = 0; j < NV; j++)
                    a[r * NV + j] = _mm512_load_ps(&acc[i0 + r][16 * j]);
            for (int64_t t = 0; t < widest; t++)   /* widest <= S - c0: no value past the keys is read */
                for (int64_t j = 0; j < NV; j++) {
                    const __m512 value = _mm512_loadu_ps(vb + t * kv_stride + 16 * j);
                    for (int64_t r = 0; r < R; r++)
                        a[r * NV + j] = _mm512_fmadd_ps(_mm512_set1_ps(probs[i0 + r][t]), value, a[r * NV + j]);
                }
            for (int64_t r = 0; r < R; r++)
                for (int64_t j = 0; j < NV; j++)
                    _mm512_store_ps(&acc[i0 + r][16 * j], a[r * NV + j]);
        }
    }
    for (int64_t i = 0; i < n; i++) {
        const float inv = 1.f / denom[i];
        for (int64_t d = 0; d < D; d++)
            out[(r0 + i) * out_stride + h * D + d] = acc[i][d] * inv;
    }
}
#endif

/* The chunk's causal attention (causal_block above): q (L, rows q_stride floats apart) and out
 * (L, rows out_stride apart), num_heads x head_dim each; k and v (S = cached + L, rows kv_stride
 * apart, num_kv_heads x head_dim each); kt scratch of num_kv_heads x head_dim x S16 floats, S16 =
 * S rounded up to 16. Returns 1, or 0 where this build has no such kernel (not AVX-512, or
 * head_dim not a multiple of 16 up to 512): then nothing is written and the caller attends another
 * way. */
int32_t kvserve_causal_attention_f32(const float *q, int64_t q_stride, const float *k, const float *v,
                                     int64_t kv_stride, float *out, int64_t out_stride, int64_t L, int64_t cached,
                                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                                     float *kt, int32_t num_threads)
{
#if defined(__AVX512F__)
    if (head_dim % 16 || head_dim > CAUSAL_MAX_HEAD_DIM)   /* a task's blocks live on its thread's stack */
        return 0;
    const int64_t S = cached + L, S16 = (S + 15) / 16 * 16, D = head_dim;
#pragma omp parallel num_threads(num_threads)
    {
        /* keys transposed, per KV head (d, s), zero past S */
#pragma omp for schedule(static)
        for (int64_t row = 0; row < num_kv_heads * D; row++) {
            const int64_t kh = row / D, d = row % D;
            float *dst = kt + row * S16;
            for (int64_t s = 0; s < S; s++)
                dst[s] = k[s * kv_stride + kh * D + d];
            for (int64_t s = S; s < S16; s++)
                dst[s] = 0.f;
        }
        const int64_t blocks = (L + 15) / 16;
        /* later blocks see more keys: handed out first, dynamically */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_heads * blocks; task++) {
            const int64_t b = blocks - 1 - task / num_heads, h = task % num_heads;
            if (D == 64)
                causal_block(q, q_stride, v, kv_stride, out, out_stride, L, cached, num_heads, num_kv_heads, 64,
                             scale, kt, S16, h, b * 16);
            else if (D == 128)
                causal_block(q, q_stride, v, kv_stride, out, out_stride, L, cached, num_heads, num_kv_heads, 128,
                             scale, kt, S16, h, b * 16);
            else
                causal_block(q, q_stride, v, kv_stride, out, out_stride, L, cached, num_heads, num_kv_heads, D,
                             scale, kt, S16, h, b * 16);
        }
    }
    return 1;
#else
    (void)q; (void)q_stride; (void)k; (void)v; (void)kv_stride; (void)out; (void)out_stride; (void)L; (void)cached;
    (void)num_heads; (void)num_kv_heads; (void)head_dim; (void)scale; (void)kt; (void)num_threads;
    return 0;
#endif
}
