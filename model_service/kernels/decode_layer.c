/* One Llama-family decoder layer for a decode step of a few sequences (one query row each),
 * float32 or bfloat16, in one call on CPU:
 *
 *   x += o_proj(attention(rope(qkv(norm(x)))))     K and V of the step written to their slots
 *   x += down(silu(gate(norm(x))) * up(norm(x)))
 *
 * Why: at one row a layer is ten native calls and a dozen small torch ops from Python, each a
 * few microseconds during which memory sits idle; here the threads stay in one parallel region
 * and go from one weight matrix to the next with only a barrier between them. The pieces are
 * the same code the separate kernels run (row_dot.h, rms_row.h, rope_head.h, attend.h), so
 * results differ from the layer's module-by-module path only where the compiler contracts a
 * product and a sum differently.
 *
 * Layouts (1 <= rows <= 8): x (rows, hidden); cos, sin (rows, head_dim / 2); slots (rows) int64, the cache slot
 * (page * page_size + offset) of each row's new token; caches, tables and seq_lens as in
 * paged_decode.c; scratch (rows, hidden + q + 2 kv + q + intermediate) float32. Weights (out,
 * in) row-major, biases and the q/k norms NULL where the model has none.
 *
 * float32: every tensor float32, the caches float32 or bfloat16 (--kv-cache-dtype). bfloat16:
 * x, cos, sin, caches, the norms' weights and the matrices bfloat16, biases float32 (widened
 * from the checkpoint's bfloat16); each step rounds
 * where the module-by-module bfloat16 path rounds (model/linear.py, layers.py: every matmul's
 * output, every op after it), with the sums float32.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attend.h"
#include "rms_row.h"
#include "rope_head.h"
#include "row_dot.h"

#ifndef KVSERVE_SOURCE_SHA256
#define KVSERVE_SOURCE_SHA256 ""
#endif
/* The SHA-256 of this file and the headers beside it as it was built (setup.py, levels.py's
   source_digest): kernels/library.py refuses a library built from another version of them. */
const char *kvserve_source_sha256(void) { return KVSERVE_SOURCE_SHA256; }

typedef struct {   /* kernels/decode_layer.py's LayerStruct: the same fields in the same order */
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    const float *input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *o_bias;
    const float *post_norm, *gate, *gate_bias, *up, *up_bias, *down, *down_bias;
} kvserve_layer;

static inline float bias_at(const float *bias, int64_t i) { return bias ? bias[i] : 0.0f; }

/* bfloat16: each row of x RMSNormed into `normed`, and the same values widened into `xn`, as the
   matmuls read them. Called inside a parallel region: the rows are shared out (orphaned `omp for`,
   with its barrier). */
static inline void norm_rows_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *normed, float *xn,
                                  int64_t rows, int64_t H, float eps)
{
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        rms_row_bf16(x + r * H, weight, normed + r * H, H, eps);
        for (int64_t j = 0; j < H; j++)
            xn[r * H + j] = bf16_to_f32(normed[r * H + j]);
    }
}

/* kv16: the caches bfloat16 (--kv-cache-dtype): each new K/V row rounded once as it is written,
   the pages widened as the attention reads them. */
static void kvserve_decode_layer_f32(const kvserve_layer *L, float *x, int64_t rows, const float *cos,
                              const float *sin, const int64_t *slots, void *k_cache, void *v_cache, int kv16,
                              int64_t page_size, const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                              float *scratch, int32_t threads)
{
    const int64_t H = L->hidden, D = L->head_dim, NH = L->num_heads, NKV = L->num_kv_heads;
    const int64_t Q = NH * D, KV = NKV * D, N = Q + 2 * KV, I = L->intermediate, half = D / 2;
    float *xn = scratch, *qkv = xn + rows * H, *att = qkv + rows * N, *h = att + rows * Q;
    int64_t per_part;
    const int64_t parts = attend_parts(rows, NKV, threads, &per_part);
    const attend_fn attend_one = pick_attend(0, kv16, D);

    /* Every `omp for` ends in a barrier: each phase reads what the one before wrote. Linear
       phases split their output columns statically, as small_linear.c does. */
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            rms_row_f32(x + r * H, L->input_norm, xn + r * H, H, L->eps);

#pragma omp for schedule(static)
        for (int64_t c = 0; c < N; c++) {
            float d[8];   /* every row against this row of the weight (row_dot.h) */
            dot_col(xn, rows, L->qkv, 0, H, c, d);
            for (int64_t r = 0; r < rows; r++)
                qkv[r * N + c] = d[r] + bias_at(L->qkv_bias, c);
        }

        /* Per head: q/k norm (Qwen3), RoPE; each K head and its V head to the row's slot. */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows * (NH + NKV); t++) {
            const int64_t r = t / (NH + NKV), head = t % (NH + NKV);
            float *v = qkv + r * N + head * D;   /* the q heads, then the k heads */
            if (L->q_norm)
                rms_row_f32(v, head < NH ? L->q_norm : L->k_norm, v, D, L->eps);
            rope_head_f32(v, cos + r * half, sin + r * half, half);
            if (head >= NH) {
                const int64_t kh = head - NH, at = slots[r] * KV + kh * D;
                const float *val = qkv + r * N + Q + KV + kh * D;
                if (kv16) {
                    for (int64_t d = 0; d < D; d++) {
                        ((uint16_t *)k_cache)[at + d] = f32_to_bf16(v[d]);
                        ((uint16_t *)v_cache)[at + d] = f32_to_bf16(val[d]);
                    }
                } else {
                    memcpy((float *)k_cache + at, v, D * sizeof(float));
                    memcpy((float *)v_cache + at, val, D * sizeof(float));
                }
            }
        }

#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < rows * parts; task++) {
            const int64_t r = task / parts, first = task % parts * per_part;
            const int64_t count = NKV - first < per_part ? NKV - first : per_part;
            attend_one(qkv + r * N, k_cache, v_cache, tables + r * table_stride, seq_lens[r],
                       att + r * Q, NH, NKV, D, page_size, L->scale, first, count);
        }

#pragma omp for schedule(static)
        for (int64_t c = 0; c < H; c++) {
            float d[8];
            dot_col(att, rows, L->o, 0, Q, c, d);
            for (int64_t r = 0; r < rows; r++)
                x[r * H + c] = apply(OP_ADD, d[r] + bias_at(L->o_bias, c), x[r * H + c]);
        }

#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            rms_row_f32(x + r * H, L->post_norm, xn + r * H, H, L->eps);

        /* gate, then up: one weight stream at a time, as the separate calls read them */
#pragma omp for schedule(static)
        for (int64_t c = 0; c < I; c++) {
            float d[8];
            dot_col(xn, rows, L->gate, 0, H, c, d);
            for (int64_t r = 0; r < rows; r++)
                h[r * I + c] = apply(OP_SILU, d[r] + bias_at(L->gate_bias, c), 0.0f);
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < I; c++) {
            float d[8];
            dot_col(xn, rows, L->up, 0, H, c, d);
            for (int64_t r = 0; r < rows; r++)
                h[r * I + c] = apply(OP_MUL, d[r] + bias_at(L->up_bias, c), h[r * I + c]);
        }

#pragma omp for schedule(static)
        for (int64_t c = 0; c < H; c++) {
            float d[8];
            dot_col(h, rows, L->down, 0, I, c, d);
            for (int64_t r = 0; r < rows; r++)
                x[r * H + c] = apply(OP_ADD, d[r] + bias_at(L->down_bias, c), x[r * H + c]);
        }
    }
}

/* The same layer in bfloat16 (see the header). Activations go through float32 scratch holding
 * bfloat16 values (xn, att, h), so every matmul reads them as small_linear.c's bfloat16 path does
 * (x widened, weights widened, float32 sums, one rounding); qkv stays bfloat16 for the attention. */
static void kvserve_decode_layer_bf16(const kvserve_layer *L, uint16_t *x, int64_t rows, const uint16_t *cos,
                               const uint16_t *sin, const int64_t *slots, uint16_t *k_cache,
                               uint16_t *v_cache, int64_t page_size, const int32_t *tables,
                               int64_t table_stride, const int32_t *seq_lens, float *scratch,
                               int32_t threads)
{
    const int64_t H = L->hidden, D = L->head_dim, NH = L->num_heads, NKV = L->num_kv_heads;
    const int64_t Q = NH * D, KV = NKV * D, N = Q + 2 * KV, I = L->intermediate, half = D / 2;
    const uint16_t *input_norm = (const uint16_t *)L->input_norm, *post_norm = (const uint16_t *)L->post_norm;
    const uint16_t *q_norm = (const uint16_t *)L->q_norm, *k_norm = (const uint16_t *)L->k_norm;
    float *xn = scratch, *att = xn + rows * H, *h = att + rows * Q;   /* float32 holding bf16 values */
    uint16_t *qkv = (uint16_t *)(h + rows * I), *normed = qkv + rows * N, *att16 = normed + rows * H;
    int64_t per_part;
    const int64_t parts = attend_parts(rows, NKV, threads, &per_part);
    const attend_fn attend_one = pick_attend(1, 1, D);

#pragma omp parallel num_threads(threads)
    {
        norm_rows_bf16(x, input_norm, normed, xn, rows, H, L->eps);

#pragma omp for schedule(static)
        for (int64_t c = 0; c < N; c++) {
            float d[8];
            dot_col(xn, rows, L->qkv, 1, H, c, d);
            for (int64_t r = 0; r < rows; r++)
                qkv[r * N + c] = f32_to_bf16(d[r] + bias_at(L->qkv_bias, c));
        }

#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows * (NH + NKV); t++) {
            const int64_t r = t / (NH + NKV), head = t % (NH + NKV);
            uint16_t *v = qkv + r * N + head * D;
            if (q_norm)
                rms_row_bf16(v, head < NH ? q_norm : k_norm, v, D, L->eps);
            rope_head_bf16(v, cos + r * half, sin + r * half, half);
            if (head >= NH) {
                const int64_t kh = head - NH, at = slots[r] * KV + kh * D;
                memcpy(k_cache + at, v, D * sizeof(uint16_t));
                memcpy(v_cache + at, qkv + r * N + Q + KV + kh * D, D * sizeof(uint16_t));
            }
        }

#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < rows * parts; task++) {
            const int64_t r = task / parts, first = task % parts * per_part;
            const int64_t count = NKV - first < per_part ? NKV - first : per_part;
            attend_one(qkv + r * N, k_cache, v_cache, tables + r * table_stride, seq_lens[r],
                       att16 + r * Q, NH, NKV, D, page_size, L->scale, first, count);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * Q; i++)
            att[i] = bf16_to_f32(att16[i]);

#pragma omp for schedule(static)
        for (int64_t c = 0; c < H; c++) {
            float d[8];
            dot_col(att, rows, L->o, 1, Q, c, d);
            for (int64_t r = 0; r < rows; r++)
                x[r * H + c] = f32_to_bf16(r16(d[r] + bias_at(L->o_bias, c)) + bf16_to_f32(x[r * H + c]));
        }

        norm_rows_bf16(x, post_norm, normed, xn, rows, H, L->eps);

#pragma omp for schedule(static)
        for (int64_t c = 0; c < I; c++) {
            float d[8];
            dot_col(xn, rows, L->gate, 1, H, c, d);
            for (int64_t r = 0; r < rows; r++)
                h[r * I + c] = r16(apply(OP_SILU, r16(d[r] + bias_at(L->gate_bias, c)), 0.0f));
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < I; c++) {
            float d[8];
            dot_col(xn, rows, L->up, 1, H, c, d);
            for (int64_t r = 0; r < rows; r++)
                h[r * I + c] = r16(r16(d[r] + bias_at(L->up_bias, c)) * h[r * I + c]);
        }

#pragma omp for schedule(static)
        for (int64_t c = 0; c < H; c++) {
            float d[8];
            dot_col(h, rows, L->down, 1, I, c, d);
            for (int64_t r = 0; r < rows; r++)
                x[r * H + c] = f32_to_bf16(r16(d[r] + bias_at(L->down_bias, c)) + bf16_to_f32(x[r * H + c]));
        }
    }
}

/* A whole decode step after the embedding: every layer (the functions above), then the final
 * RMSNorm and the LM head, in one call, so that no Python runs between the weight streams. The
 * head's weight is the plain (vocab, hidden) matrix, no bias; logits (rows, vocab) float32, in
 * bfloat16 rounded to bfloat16 as the module path's bfloat16 logits are. The norm and the head
 * are the code the separate kernels run (rms_row.h, row_dot.h): the same results. */
typedef struct {   /* kernels/decode_layer.py's ModelStruct: the same fields in the same order */
    int64_t num_layers, vocab;
    float eps;
    const kvserve_layer *layers;    /* num_layers of them */
    void *const *k_caches;          /* each layer's */
    void *const *v_caches;
    const void *final_norm;         /* (hidden) */
    const void *head;               /* (vocab, hidden) */
} kvserve_model;

/* bf16 = 0: x, cos, sin and the weights float32, the caches float32 (kv16 = 0) or bfloat16 (kv16 = 1);
   bf16 = 1: all bfloat16. */
void kvserve_decode_step(const kvserve_model *M, void *x, int64_t rows, const void *cos, const void *sin,
                         const int64_t *slots, int64_t page_size, const int32_t *tables, int64_t table_stride,
                         const int32_t *seq_lens, float *scratch, float *logits, int32_t bf16, int32_t kv16,
                         int32_t threads)
{
    for (int64_t l = 0; l < M->num_layers; l++) {
        if (bf16)
            kvserve_decode_layer_bf16(M->layers + l, x, rows, cos, sin, slots, M->k_caches[l], M->v_caches[l],
                                      page_size, tables, table_stride, seq_lens, scratch, threads);
        else
            kvserve_decode_layer_f32(M->layers + l, x, rows, cos, sin, slots, M->k_caches[l], M->v_caches[l], kv16,
                                     page_size, tables, table_stride, seq_lens, scratch, threads);
    }
    const int64_t H = M->layers[0].hidden, V = M->vocab;
    float *xn = scratch;   /* the normed rows as the head reads them (in bfloat16: bf16 values) */
#pragma omp parallel num_threads(threads)
    {
        if (bf16) {
            norm_rows_bf16(x, M->final_norm, (uint16_t *)(xn + rows * H), xn, rows, H, M->eps);
        } else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                rms_row_f32((const float *)x + r * H, M->final_norm, xn + r * H, H, M->eps);
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < V; c++) {
            float d[8];
            dot_col(xn, rows, M->head, bf16, H, c, d);
            for (int64_t r = 0; r < rows; r++)
                logits[r * V + c] = bf16 ? r16(d[r]) : d[r];
        }
    }
}
