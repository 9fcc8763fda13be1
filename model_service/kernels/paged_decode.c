/* Paged decode attention on CPU, float32 or bfloat16: one query token per sequence.
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
