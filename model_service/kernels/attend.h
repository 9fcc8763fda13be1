/* One sequence's decode attention over its pages (the online-softmax loop), float32 or
 * bfloat16 queries over float32 or bfloat16 pages, shared by paged_decode.c and
 * decode_layer.c (included, never built alone). Layout: paged_decode.c's header comment. */
#ifndef KVSERVE_ATTEND_H
#define KVSERVE_ATTEND_H
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* Random pages defeat the hardware prefetcher at every page boundary, so the next
 * page's loads are started by hand, one token record of K and of V beside each
 * token of this page: spread out, they keep memory busy while this page is
 * computed. Issued all at once, a page's 256 cache lines queue behind each other;
 * one page ahead measured best of 1-4 (docs/benchmarks.md, "The cpu attention
 * backend"). Into L2 (prefetcht1), not L1: a thread then has more loads in flight, and
 * 32 sequences' attention ran ~20 % faster (docs/benchmarks.md, "One request at a time and
 * 32 at once"). */
static inline void prefetch(const void *p, int64_t bytes)
{
    const char *c = (const char *)p;
    for (int64_t b = 0; b < bytes; b += 64)
        __builtin_prefetch(c + b, 0, 2);
}

/* Element i of a float32 (bf16 = 0) or bfloat16 array, as float32. bf16 is a constant in
   every inlined copy of attend, so each copy's loops load one type and vectorise. */
static inline __attribute__((always_inline)) float load(const void *p, int64_t i, int bf16)
{
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Both attends' start: queries pre-scaled (float32), sums and maxima empty. */
static inline __attribute__((always_inline)) void
attend_begin(const void *q, int64_t first_q, int64_t heads, int64_t head_dim, float scale, int bf16,
             float qs[heads][head_dim], float acc[heads][head_dim], float *running_max, float *denom)
{
    for (int64_t h = 0; h < heads; h++) {
        running_max[h] = -FLT_MAX;     /* not -inf: built with -ffinite-math-only */
        denom[h] = 0.f;
        for (int64_t d = 0; d < head_dim; d++) {
            acc[h][d] = 0.f;
            qs[h][d] = load(q, first_q + h * head_dim + d, bf16) * scale;
        }
    }
}

/* Both attends' end: each query head's sum over its softmax denominator, rounded once. */
static inline __attribute__((always_inline)) void
attend_end(void *out, int64_t first_q, int64_t heads, int64_t head_dim, int bf16,
           float acc[heads][head_dim], const float *denom)
{
    for (int64_t h = 0; h < heads; h++) {
        const float inv = 1.f / denom[h];
        for (int64_t d = 0; d < head_dim; d++) {
            const int64_t i = first_q + h * head_dim + d;
            if (bf16)
                ((uint16_t *)out)[i] = f32_to_bf16(acc[h][d] * inv);
            else
                ((float *)out)[i] = acc[h][d] * inv;
        }
    }
}

/* Inlined into one copy per common head_dim (below), where the constant lets the
 * compiler unroll every dot product and row update: far less arithmetic than
 * with head_dim known only at run time (docs/benchmarks.md).
 * One call attends KV heads [kv_first, kv_first + kv_count) of one sequence and the query
 * heads that read them; q and out point at the sequence's first query head. */
static inline __attribute__((always_inline)) void
attend(const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
       int64_t len, void *out, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
       int64_t page_size, float scale, int64_t kv_first, int64_t kv_count, int q16, int kv16)
{
    const int64_t elem = kv16 ? 2 : 4;   /* a cache element's bytes */
    const int64_t group = num_heads / num_kv_heads;
    const int64_t heads = kv_count * group;          /* the query heads of this call */
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t page_stride = page_size * token_stride;
    const int64_t num_pages = (len + page_size - 1) / page_size;
    const int64_t head_offset = kv_first * head_dim;  /* this call's K/V within a token record */
    float acc[heads][head_dim];    /* unnormalised output per query head */
    float qs[heads][head_dim];     /* queries, pre-scaled */
    float scores[heads][page_size];
    float running_max[heads], denom[heads];

    const int64_t first_q = kv_first * group * head_dim;   /* this call's queries and outputs */
    attend_begin(q, first_q, heads, head_dim, scale, q16, qs, acc, running_max, denom);
    for (int64_t p = 0; p < num_pages; p++) {
        const int64_t n = len - p * page_size < page_size ? len - p * page_size : page_size;
        const int64_t keys = (int64_t)table[p] * page_stride + head_offset;   /* in elements */
        /* Only the last page is partial, and nothing follows it. */
        const int has_next = p + 1 < num_pages;
        const int64_t next = has_next ? (int64_t)table[p + 1] * page_stride + head_offset : keys;

        for (int64_t t = 0; t < n; t++) {
            if (has_next) {
                const int64_t at = (next + t * token_stride) * elem;
                prefetch((const char *)k_cache + at, kv_count * head_dim * elem);
                prefetch((const char *)v_cache + at, kv_count * head_dim * elem);
            }
            for (int64_t kh = 0; kh < kv_count; kh++) {
                const int64_t k = keys + t * token_stride + kh * head_dim;
                for (int64_t h = kh * group; h < (kh + 1) * group; h++) {
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; d++)
                        dot += qs[h][d] * load(k_cache, k + d, kv16);
                    scores[h][t] = dot;
                }
            }
        }
        /* Online softmax: rescale what was summed so far to this page's new maximum. */
        for (int64_t h = 0; h < heads; h++) {
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
            for (int64_t kh = 0; kh < kv_count; kh++) {
                const int64_t v = keys + t * token_stride + kh * head_dim;
                for (int64_t h = kh * group; h < (kh + 1) * group; h++) {
                    const float w = scores[h][t];
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++)
                        acc[h][d] += w * load(v_cache, v + d, kv16);
                }
            }
    }
    attend_end(out, first_q, heads, head_dim, q16, acc, denom);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

/* The vector attend below (attend_simd) is written once over a small vector layer: 16 floats
 * a vector with AVX-512, 8 with AVX2 (the x86-64-v3 build, where most AMD EPYC and older Xeon
 * servers land). A chunk of a page, 16 tokens, is one vector of scores or two. */
#if defined(__AVX512F__)
typedef __m512 vf;
enum { VL = 16 };
#define vf_load _mm512_loadu_ps
#define vf_load_aligned _mm512_load_ps
#define vf_store_aligned _mm512_store_ps
#define vf_fmadd _mm512_fmadd_ps
#define vf_mul _mm512_mul_ps
#define vf_add _mm512_add_ps
#define vf_sub _mm512_sub_ps
#define vf_set1 _mm512_set1_ps
#define vf_zero _mm512_setzero_ps

/* Lane t of the result: the sum of the 16 lanes of v[t]. A tree of unpacks and shuffles that
 * shares its steps between the 16 sums: ~3 instructions a sum, where reducing each vector on
 * its own takes ~8 (a decode step's scores are 16 such sums a page per query head). */
static inline vf vf_sum_each(const vf v[16])
{
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)   /* per 128-bit lane: [v2i, v2i+1, v2i, v2i+1] partial sums */
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)   /* per 128-bit lane: [v4i, v4i+1, v4i+2, v4i+3] */
        x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
    /* lanes 0-1 of 128 bits from one vector, 2-3 from the other, halves of each sum added */
    const __m512 s0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x44), _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
    const __m512 s1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x44), _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s0, s1, 0x88), _mm512_shuffle_f32x4(s0, s1, 0xDD));
}

/* The largest of the first m lanes of v (1 <= m <= VL). */
static inline float vf_max_first(vf v, int64_t m)
{
    return _mm512_mask_reduce_max_ps((__mmask16)((1u << m) - 1), v);
}

/* The first m floats at p (VL x 4 bytes aligned), 0 in the lanes past them. */
static inline vf vf_load_first(const float *p, int64_t m)
{
    return _mm512_maskz_load_ps((__mmask16)((1u << m) - 1), p);
}

#define vf_sum _mm512_reduce_add_ps

/* VL elements at p (float32, or bfloat16 widened) */
static inline vf vf_load_widened(const void *p, int bf16)
{
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps(p);
}

enum { VALUE_ACCUMULATORS = 16 };   /* of 32 registers */
#else
typedef __m256 vf;
enum { VL = 8 };
#define vf_load _mm256_loadu_ps
#define vf_load_aligned _mm256_load_ps
#define vf_store_aligned _mm256_store_ps
#define vf_fmadd _mm256_fmadd_ps
#define vf_mul _mm256_mul_ps
#define vf_add _mm256_add_ps
#define vf_sub _mm256_sub_ps
#define vf_set1 _mm256_set1_ps
#define vf_zero _mm256_setzero_ps

/* Lane t of the result: the sum of the 8 lanes of v[t], by horizontal adds shared between the
 * 8 sums (~1.5 instructions a sum). */
static inline vf vf_sum_each(const vf v[8])
{
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* a: [v0..v3 low halves' sums | v0..v3 high halves'], b the same for v4..v7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

static inline __m256i first_lanes(int64_t m)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline float vf_max_first(vf v, int64_t m)
{
    float lanes[8] __attribute__((aligned(32)));
    _mm256_store_ps(lanes, v);
    float top = lanes[0];
    for (int64_t t = 1; t < m; t++)
        top = lanes[t] > top ? lanes[t] : top;
    return top;
}

static inline vf vf_load_first(const float *p, int64_t m)
{
    return _mm256_maskload_ps(p, first_lanes(m));
}

static inline float vf_sum(vf v)
{
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

static inline vf vf_load_widened(const void *p, int bf16)
{
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps(p);
}

enum { VALUE_ACCUMULATORS = 8 };    /* of 16 registers */
#endif

enum { ATTEND_CHUNK = 16 };   /* tokens of a page attend_simd takes at once */

/* Query heads whose value sums one pass of add_values takes: R x NV accumulators, at most
 * VALUE_ACCUMULATORS (AVX-512, head_dim 64: four heads, 128: two), so that each value vector is
 * loaded once for R heads and R x NV independent sums hide the FMA's latency, which one head's NV
 * sums alone wait on. */
#define VALUE_HEADS(NV) ((NV) <= VALUE_ACCUMULATORS / 4 ? 4 : (NV) <= VALUE_ACCUMULATORS / 2 ? 2 : 1)

/* R query heads' accumulators (rows of acc, head_dim apart) += the chunk's m values (rows of vr,
 * stride apart) weighted by their probabilities (rows of probs, ATTEND_CHUNK apart), in passes of as many
 * columns as VALUE_ACCUMULATORS registers hold. Each sum takes the values in token order, as a
 * head at a time did: the results are the same to the bit. */
static inline __attribute__((always_inline)) void
add_values(const float *vr, int64_t stride, int64_t m, const int64_t NV, const int64_t R,
           const float *probs, float *acc, int64_t head_dim)
{
    const int64_t JB = NV < VALUE_ACCUMULATORS / R ? NV : VALUE_ACCUMULATORS / R;   /* vectors a pass */
    for (int64_t j0 = 0; j0 < NV; j0 += JB) {
        vf a[VALUE_ACCUMULATORS];
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < JB; j++)
                a[r * JB + j] = vf_load_aligned(acc + r * head_dim + VL * (j0 + j));
        for (int64_t t = 0; t < m; t++)
            for (int64_t j = 0; j < JB; j++) {
                const vf value = vf_load(vr + t * stride + VL * (j0 + j));
                for (int64_t r = 0; r < R; r++)
                    a[r * JB + j] = vf_fmadd(vf_set1(probs[ATTEND_CHUNK * r + t]), value, a[r * JB + j]);
            }
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < JB; j++)
                vf_store_aligned(acc + r * head_dim + VL * (j0 + j), a[r * JB + j]);
    }
}

/* attend() for head_dim 64 or 128 (a constant in each inlined copy; add_values' passes need a
 * multiple of VALUE_ACCUMULATORS x VL where it exceeds that), in chunks of up to 16 tokens of a page:
 * per KV head, the chunk's keys are read where they lie (float32) or widened once into a buffer
 * (bfloat16; copying float32 ones too was measurably slower, docs/benchmarks.md, "The native GEMM
 * by rows"), each of its query heads takes the 16 scores as one or two vectors (vf_sum_each), the
 * softmax runs on them, and the values, read the same way, are summed into accumulators held in
 * registers for the chunk. The same sums as attend(), in
 * another order: results differ from it by rounding. */
static inline __attribute__((always_inline)) void
attend_simd(const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
            int64_t len, void *out, int64_t num_heads, int64_t num_kv_heads, const int64_t head_dim,
            int64_t page_size, float scale, int64_t kv_first, int64_t kv_count, int q16, int kv16)
{
    enum { CHUNK = ATTEND_CHUNK, SV = CHUNK / VL };   /* vectors of a chunk's scores */
    const int64_t NV = head_dim / VL;                /* vectors per head */
    const int64_t elem = kv16 ? 2 : 4;   /* a cache element's bytes */
    const int64_t group = num_heads / num_kv_heads;
    const int64_t heads = kv_count * group;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t page_stride = page_size * token_stride;
    const int64_t num_pages = (len + page_size - 1) / page_size;
    const int64_t first_q = kv_first * group * head_dim;
    float acc[heads][head_dim] __attribute__((aligned(64)));
    float qs[heads][head_dim] __attribute__((aligned(64)));
    float kf[CHUNK][head_dim] __attribute__((aligned(64)));   /* bfloat16 pages: a chunk's keys (or values) widened */
    float probs[group][CHUNK] __attribute__((aligned(64)));
    float running_max[heads], denom[heads];

    attend_begin(q, first_q, heads, head_dim, scale, q16, qs, acc, running_max, denom);
    for (int64_t p = 0; p < num_pages; p++) {
        const int64_t n = len - p * page_size < page_size ? len - p * page_size : page_size;
        const int64_t page = (int64_t)table[p] * page_stride;   /* in elements */
        const int has_next = p + 1 < num_pages;
        const int64_t next = has_next ? (int64_t)table[p + 1] * page_stride + kv_first * head_dim : 0;
        int64_t prefetched = 0;   /* tokens of the next page whose records are on their way */
        for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
            const int64_t m = n - c0 < CHUNK ? n - c0 : CHUNK;
            for (int64_t kh = 0; kh < kv_count; kh++) {
                const int64_t base = page + c0 * token_stride + (kv_first + kh) * head_dim;
                const float *kr = kv16 ? &kf[0][0] : (const float *)k_cache + base;
                const int64_t kr_stride = kv16 ? head_dim : token_stride;
                if (kv16)
                    for (int64_t t = 0; t < m; t++)
                        for (int64_t j = 0; j < NV; j++)
                            vf_store_aligned(&kf[t][VL * j],
                                             vf_load_widened((const char *)k_cache + (base + t * token_stride + VL * j) * elem, kv16));
                for (int64_t g = 0; g < group; g++) {
                    const int64_t h = kh * group + g;
                    if (has_next)   /* the next page's records for this chunk, spread over its heads */
                        for (int64_t end = c0 + (h + 1) * m / heads; prefetched < end; prefetched++) {
                            const int64_t at = (next + prefetched * token_stride) * elem;
                            prefetch((const char *)k_cache + at, kv_count * head_dim * elem);
                            prefetch((const char *)v_cache + at, kv_count * head_dim * elem);
                        }
                    vf dots[CHUNK], qv[NV], scores[SV];
                    for (int64_t j = 0; j < NV; j++)
                        qv[j] = vf_load_aligned(&qs[h][VL * j]);
                    for (int64_t t = 0; t < m; t++) {
                        const float *key = kr + t * kr_stride;
                        vf even = vf_mul(qv[0], vf_load(key));
                        vf odd = vf_mul(qv[1], vf_load(key + VL));
                        for (int64_t j = 2; j < NV; j += 2) {   /* two chains: half the latency */
                            even = vf_fmadd(qv[j], vf_load(key + VL * j), even);
                            odd = vf_fmadd(qv[j + 1], vf_load(key + VL * j + VL), odd);
                        }
                        dots[t] = vf_add(even, odd);
                    }
                    for (int64_t t = m; t < CHUNK; t++)
                        dots[t] = vf_zero();
                    float top = -FLT_MAX;
                    for (int64_t i = 0; i < SV; i++) {
                        scores[i] = vf_sum_each(dots + VL * i);
                        if (m > VL * i) {
                            const float ti = vf_max_first(scores[i], m - VL * i < VL ? m - VL * i : VL);
                            top = ti > top ? ti : top;
                        }
                    }
                    const float m_new = top > running_max[h] ? top : running_max[h];
                    const float correction = expf(running_max[h] - m_new);
                    running_max[h] = m_new;
                    for (int64_t i = 0; i < SV; i++)
                        vf_store_aligned(probs[g] + VL * i, vf_sub(scores[i], vf_set1(m_new)));
#pragma omp simd
                    for (int64_t t = 0; t < CHUNK; t++)
                        probs[g][t] = expf(probs[g][t]);
                    vf sum = vf_zero();
                    for (int64_t i = 0; i < SV; i++) {   /* 0 past the chunk */
                        const int64_t live = m - VL * i < 0 ? 0 : m - VL * i < VL ? m - VL * i : VL;
                        const vf e = vf_load_first(probs[g] + VL * i, live);
                        vf_store_aligned(probs[g] + VL * i, e);
                        sum = vf_add(sum, e);
                    }
                    denom[h] = denom[h] * correction + vf_sum(sum);
                    if (correction != 1.f)
                        for (int64_t j = 0; j < NV; j++)
                            vf_store_aligned(&acc[h][VL * j], vf_mul(vf_load_aligned(&acc[h][VL * j]),
                                                                     vf_set1(correction)));
                }
                const float *vr = kv16 ? &kf[0][0] : (const float *)v_cache + base;
                if (kv16)   /* the values, widened once */
                    for (int64_t t = 0; t < m; t++)
                        for (int64_t j = 0; j < NV; j++)
                            vf_store_aligned(&kf[t][VL * j],
                                             vf_load_widened((const char *)v_cache + (base + t * token_stride + VL * j) * elem, kv16));
                int64_t g = 0;
                for (; g + VALUE_HEADS(NV) <= group; g += VALUE_HEADS(NV))
                    add_values(vr, kr_stride, m, NV, VALUE_HEADS(NV), probs[g], acc[kh * group + g], head_dim);
                for (; g < group; g++)
                    add_values(vr, kr_stride, m, NV, 1, probs[g], acc[kh * group + g], head_dim);
            }
        }
    }
    attend_end(out, first_q, heads, head_dim, q16, acc, denom);
}
#define ATTEND_FIXED attend_simd   /* head_dim 64 and 128 */
#else
#define ATTEND_FIXED attend
#endif

#define ATTEND_WITH(name, how, dim, q16, kv16)                                              \
    static void name(const void *q, const void *k_cache, const void *v_cache,               \
                     const int32_t *table, int64_t len, void *out, int64_t num_heads,       \
                     int64_t num_kv_heads, int64_t head_dim, int64_t page_size, float scale, \
                     int64_t kv_first, int64_t kv_count)                                    \
    {                                                                                       \
        how(q, k_cache, v_cache, table, len, out, num_heads, num_kv_heads, dim,             \
            page_size, scale, kv_first, kv_count, q16, kv16);                               \
    }
/* q and out float32 or bfloat16, the caches float32 or bfloat16: the three pairs kvserve runs
   (a float32 model's cache may be bfloat16, --kv-cache-dtype; a bfloat16 model's never float32). */
ATTEND_WITH(attend_d64, ATTEND_FIXED, 64, 0, 0)
ATTEND_WITH(attend_d128, ATTEND_FIXED, 128, 0, 0)
ATTEND_WITH(attend_any, attend, head_dim, 0, 0)
ATTEND_WITH(attend_d64_bf16, ATTEND_FIXED, 64, 1, 1)
ATTEND_WITH(attend_d128_bf16, ATTEND_FIXED, 128, 1, 1)
ATTEND_WITH(attend_any_bf16, attend, head_dim, 1, 1)
ATTEND_WITH(attend_d64_kv16, ATTEND_FIXED, 64, 0, 1)
ATTEND_WITH(attend_d128_kv16, ATTEND_FIXED, 128, 0, 1)
ATTEND_WITH(attend_any_kv16, attend, head_dim, 0, 1)

typedef void (*attend_fn)(const void *, const void *, const void *, const int32_t *, int64_t,
                          void *, int64_t, int64_t, int64_t, int64_t, float, int64_t, int64_t);

/* How a step's decode attention is shared out: with at least as many sequences as threads,
 * one task per sequence (a sequence's pages read once, by one thread); with fewer (one request
 * alone), each sequence's KV heads split between tasks so every thread streams its share.
 * -> tasks per sequence; *per_part: KV heads per task. */
static inline int64_t attend_parts(int64_t num_seqs, int64_t num_kv_heads, int64_t num_threads,
                                   int64_t *per_part)
{
    int64_t parts = num_seqs >= num_threads ? 1 : (num_threads + num_seqs - 1) / num_seqs;
    parts = parts < num_kv_heads ? parts : num_kv_heads;
    *per_part = (num_kv_heads + parts - 1) / parts;
    return (num_kv_heads + *per_part - 1) / *per_part;   /* no empty part */
}

/* q16: q and out bfloat16 (then so are the caches); kv16: the caches bfloat16. */
static inline attend_fn pick_attend(int q16, int kv16, int64_t head_dim)
{
    if (q16)
        return head_dim == 64 ? attend_d64_bf16 : head_dim == 128 ? attend_d128_bf16 : attend_any_bf16;
    if (kv16)
        return head_dim == 64 ? attend_d64_kv16 : head_dim == 128 ? attend_d128_kv16 : attend_any_kv16;
    return head_dim == 64 ? attend_d64 : head_dim == 128 ? attend_d128 : attend_any;
}

#endif
