/* RMSNorm of one row, shared by rms_norm.c and decode_layer.c (included, never built alone):
 * y = weight * (x * 1/sqrt(mean(x²) + eps)), as transformers computes it: in float32, or for a
 * bfloat16 row the normalisation in float32 rounded before the weight multiplies it, and the
 * product rounded again. */
#ifndef KVSERVE_RMS_ROW_H
#define KVSERVE_RMS_ROW_H
#include <math.h>
#include <stdint.h>

#include "bf16.h"

static inline float sum_squares(const float *x, int64_t n) {
    float lanes[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; ++l)
            lanes[l] += x[j + l] * x[j + l];
    float s = 0.0f;
    for (int l = 0; l < 8; ++l)
        s += lanes[l];
    for (; j < n; ++j)
        s += x[j] * x[j];
    return s;
}

static inline void rms_row_f32(const float *x, const float *weight, float *y, int64_t n, float eps) {
    float scale = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int64_t j = 0; j < n; ++j)
        y[j] = weight[j] * (x[j] * scale);
}

static inline void rms_row_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *y, int64_t n, float eps) {
    float squares = 0.0f, lanes[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; ++l) {
            float v = bf16_to_f32(x[j + l]);
            lanes[l] += v * v;
        }
    for (int l = 0; l < 8; ++l)
        squares += lanes[l];
    for (; j < n; ++j) {
        float v = bf16_to_f32(x[j]);
        squares += v * v;
    }
    float scale = 1.0f / sqrtf(squares / (float)n + eps);
    for (j = 0; j < n; ++j) {
        float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[j]) * scale));
        y[j] = f32_to_bf16(bf16_to_f32(weight[j]) * normed);
    }
}

#endif
