/* Rotary position embedding of one float32 head in place: [x1, x2] -> [x1 cos - x2 sin,
 * x2 cos + x1 sin] over its two halves (model/rope.py). Shared by rope.c and decode_layer.c
 * (included, never built alone). */
#ifndef KVSERVE_ROPE_HEAD_H
#define KVSERVE_ROPE_HEAD_H
#include <stdint.h>

static inline void rope_head_f32(float *x, const float *c, const float *s, int64_t half) {
    float *x1 = x, *x2 = x + half;
    #pragma omp simd
    for (int64_t j = 0; j < half; ++j) {
        float a = x1[j], b = x2[j];
        x1[j] = a * c[j] - b * s[j];
        x2[j] = b * c[j] + a * s[j];
    }
}

#endif
