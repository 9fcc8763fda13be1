/* Rotary position embedding of one head in place: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]
 * over its two halves (model/rope.py), in float32, or in bfloat16 rounded after each multiply
 * and each sum, as transformers' bfloat16 ops round. Shared by rope.c and decode_layer.c
 * (included, never built alone). */
#ifndef KVSERVE_ROPE_HEAD_H
#define KVSERVE_ROPE_HEAD_H
#include <stdint.h>

#include "bf16.h"

static inline void rope_head_f32(float *x, const float *c, const float *s, int64_t half) {
    float *x1 = x, *x2 = x + half;
    #pragma omp simd
    for (int64_t j = 0; j < half; ++j) {
        float a = x1[j], b = x2[j];
        x1[j] = a * c[j] - b * s[j];
        x2[j] = b * c[j] + a * s[j];
    }
}

static inline float r16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline void rope_head_bf16(uint16_t *x, const uint16_t *c, const uint16_t *s, int64_t half) {
    uint16_t *x1 = x, *x2 = x + half;
    for (int64_t j = 0; j < half; ++j) {
        float a = bf16_to_f32(x1[j]), b = bf16_to_f32(x2[j]);
        float cj = bf16_to_f32(c[j]), sj = bf16_to_f32(s[j]);
        x1[j] = f32_to_bf16(r16(a * cj) - r16(b * sj));
        x2[j] = f32_to_bf16(r16(b * cj) + r16(a * sj));
    }
}

#endif
