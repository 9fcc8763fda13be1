/* Paged decode attention on CPU, float32: one query token per sequence.
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
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#ifndef KVSERVE_SOURCE_SHA256
#define KVSERVE_SOURCE_SHA256 ""
#endif
/* The SHA-256 of this file as it was built (setup.py): kernels/library.py refuses a library
   built from another version of the source. */
const char *kvserve_source_sha256(void) { return KVSERVE_SOURCE_SHA256; }

/* Random pages defeat the hardware prefetcher at every page boundary, so the next
 * page's loads are started by hand, one token record of K and of V beside each
 * token of this page: spread out, they keep memory busy while this page is
 * computed. Issued all at once, a page's 256 cache lines queue behind each other;
 * one page ahead measured best of 1-4 (docs/benchmarks.md, "The cpu attention
 * backend"). */
static inline void prefetch(const float *p, int64_t floats)
{
    const char *c = (const char *)p;
    for (int64_t b = 0; b < floats * (int64_t)sizeof(float); b += 64)
        __builtin_prefetch(c + b);
}

/* Inlined into one copy per common head_dim (below), where the constant lets the
 * compiler unroll every dot product and row update: far less arithmetic than
 * with head_dim known only at run time (docs/benchmarks.md). */
static inline __attribute__((always_inline)) void
attend(const float *q, const float *k_cache, const float *v_cache, const int32_t *table,
       int64_t len, float *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
       int64_t page_size, float scale)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t page_stride = page_size * token_stride;
    const int64_t num_pages = (len + page_size - 1) / page_size;
    float acc[num_heads][head_dim];    /* unnormalised output per query head */
    float qs[num_heads][head_dim];     /* queries, pre-scaled */
    float scores[num_heads][page_size];
    float running_max[num_heads], denom[num_heads];

    for (int64_t h = 0; h < num_heads; h++) {
        running_max[h] = -FLT_MAX;     /* not -inf: built with -ffinite-math-only */
        denom[h] = 0.f;
        for (int64_t d = 0; d < head_dim; d++) {
            acc[h][d] = 0.f;
            qs[h][d] = q[h * head_dim + d] * scale;
        }
    }
    for (int64_t p = 0; p < num_pages; p++) {
        const int64_t n = len - p * page_size < page_size ? len - p * page_size : page_size;
        const float *keys = k_cache + (int64_t)table[p] * page_stride;
        const float *values = v_cache + (int64_t)table[p] * page_stride;
        /* Only the last page is partial, and nothing follows it. */
        const int has_next = p + 1 < num_pages;
        const float *next_keys = has_next ? k_cache + (int64_t)table[p + 1] * page_stride : keys;
        const float *next_values = has_next ? v_cache + (int64_t)table[p + 1] * page_stride : values;

        for (int64_t t = 0; t < n; t++) {
            if (has_next) {
                prefetch(next_keys + t * token_stride, token_stride);
                prefetch(next_values + t * token_stride, token_stride);
            }
            for (int64_t kh = 0; kh < num_kv_heads; kh++) {
                const float *k = keys + t * token_stride + kh * head_dim;
                for (int64_t h = kh * group; h < (kh + 1) * group; h++) {
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; d++)
                        dot += qs[h][d] * k[d];
                    scores[h][t] = dot;
                }
            }
        }
        /* Online softmax: rescale what was summed so far to this page's new maximum. */
        for (int64_t h = 0; h < num_heads; h++) {
            float m = running_max[h];
            for (int64_t t = 0; t < n; t++)
                m = scores[h][t] > m ? scores[h][t] : m;
            const float correction = expf(running_max[h] - m);
            running_max[h] = m;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                scores[h][t] = expf(scores[h][t] - m);
                sum += scores[h][t];
            }
            denom[h] = denom[h] * correction + sum;
            if (correction != 1.f)
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++)
                    acc[h][d] *= correction;
        }
        for (int64_t t = 0; t < n; t++)
            for (int64_t kh = 0; kh < num_kv_heads; kh++) {
                const float *v = values + t * token_stride + kh * head_dim;
                for (int64_t h = kh * group; h < (kh + 1) * group; h++) {
                    const float w = scores[h][t];
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++)
                        acc[h][d] += w * v[d];
                }
            }
    }
    for (int64_t h = 0; h < num_heads; h++) {
        const float inv = 1.f / denom[h];
        for (int64_t d = 0; d < head_dim; d++)
            out[h * head_dim + d] = acc[h][d] * inv;
    }
}

#define ATTEND_WITH_HEAD_DIM(name, dim)                                                     \
    static void name(const float *q, const float *k_cache, const float *v_cache,            \
                     const int32_t *table, int64_t len, float *out, int64_t num_heads,      \
                     int64_t num_kv_heads, int64_t head_dim, int64_t page_size, float scale) \
    {                                                                                       \
        attend(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, dim,          \
               page_size, scale);                                                           \
    }
ATTEND_WITH_HEAD_DIM(attend_d64, 64)
ATTEND_WITH_HEAD_DIM(attend_d128, 128)
ATTEND_WITH_HEAD_DIM(attend_any, head_dim)

void kvserve_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                              const int32_t *tables, int64_t table_stride,
                              const int32_t *seq_lens, float *out, int64_t num_seqs,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t page_size, float scale, int32_t num_threads)
{
    /* One task per sequence: a sequence's pages are read once, by one thread. Dynamic
     * scheduling evens out sequences of different lengths. */
    void (*attend_one)(const float *, const float *, const float *, const int32_t *, int64_t,
                       float *, int64_t, int64_t, int64_t, int64_t, float) =
        head_dim == 64 ? attend_d64 : head_dim == 128 ? attend_d128 : attend_any;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t s = 0; s < num_seqs; s++)
        attend_one(q + s * num_heads * head_dim, k_cache, v_cache, tables + s * table_stride,
                   seq_lens[s], out + s * num_heads * head_dim, num_heads, num_kv_heads,
                   head_dim, page_size, scale);
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
