/*
 * Token-wise ops of the decoder layers for CPU worker processes, float32 and bfloat16: the
 * residual add fused into the RMSNorm that follows it.
 *
 * Built on first use by worker/layers/cpu_ops.py (through worker/native.py) with the system C
 * compiler and loaded with ctypes; plain C, like the attention kernel, whose vector helpers it
 * shares. In torch the add and the norm are five ops and eight passes over the rows (add, the
 * sum of squares, two scalings, each reading or writing a fresh tensor); here one pass adds,
 * stores the sum and accumulates its squares while the row is in L1, and a second scales it.
 * The caller guarantees float32, dense rows and the sizes.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "../../attention/csrc/vector_math.h"

#define CONVEYOR_TOKEN_OPS_ABI_VERSION 2
/* Below this many elements the OpenMP fork costs more than the second thread saves (a decode
 * batch of a few rows). */
#define PARALLEL_MIN_ELEMENTS 16384

int conveyor_token_ops_abi_version(void) { return CONVEYOR_TOKEN_OPS_ABI_VERSION; }

/* The sum of squares of row[0:size], summed[0:size] = row + added (when added is not NULL). */
static inline float add_and_square(const float *row, const float *added, float *summed,
                                   int size) {
    vf8 acc0 = splat(0.0f), acc1 = splat(0.0f);
    float tail = 0.0f;
    int i = 0;
    if (added) {
        for (; i + 2 * LANES <= size; i += 2 * LANES) {
            vf8 a = load(row + i) + load(added + i);
            vf8 b = load(row + i + LANES) + load(added + i + LANES);
            store(summed + i, a);
            store(summed + i + LANES, b);
            acc0 += a * a;
            acc1 += b * b;
        }
        for (; i < size; i++) {
            float a = row[i] + added[i];
            summed[i] = a;
            tail += a * a;
        }
    } else {
        for (; i + 2 * LANES <= size; i += 2 * LANES) {
            vf8 a = load(row + i), b = load(row + i + LANES);
            acc0 += a * a;
            acc1 += b * b;
        }
        for (; i < size; i++) tail += row[i] * row[i];
    }
    return hsum(acc0 + acc1) + tail;
}

/* For every row r: s = x[r] + residual[r] (x[r] alone when residual is NULL), then
 * out[r] = (s / sqrt(mean(s^2) + eps)) * weight, and summed[r] = s (when residual is given): the
 * same order of operations as Hugging Face's float32 RMSNorm (normalise, then scale). */
int conveyor_add_rms_norm(const float *x, int64_t x_stride, const float *residual,
                          int64_t residual_stride, const float *weight, int64_t num_rows,
                          int size, float eps, float *out, int64_t out_stride, float *summed,
                          int64_t summed_stride, int num_threads) {
    if (size <= 0 || num_rows < 0 || (residual && !summed)) return -1;
    const int parallel = num_rows * (int64_t)size >= PARALLEL_MIN_ELEMENTS && num_threads > 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *row = x + r * x_stride;
        const float *added = residual ? residual + r * residual_stride : NULL;
        float *sum_row = residual ? summed + r * summed_stride : NULL;
        const float *normed = residual ? sum_row : row;
        float *dst = out + r * out_stride;
        const float sum_of_squares = add_and_square(row, added, sum_row, size);
        const float inverse_rms = 1.0f / sqrtf(sum_of_squares / (float)size + eps);
        const vf8 scale = splat(inverse_rms);
        int i = 0;
        for (; i + LANES <= size; i += LANES)
            store(dst + i, load(normed + i) * scale * load(weight + i));
        for (; i < size; i++) dst[i] = normed[i] * inverse_rms * weight[i];
    }
    return 0;
}

/* The bfloat16 form, rounding where Hugging Face's bfloat16 model rounds: s = bf16(x + residual)
 * (stored to summed), n = bf16(s / sqrt(mean(s^2) + eps)) with the mean in float32, then
 * out = bf16(weight * n). size must be a multiple of 8. */
int conveyor_add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual,
                               int64_t residual_stride, const uint16_t *weight,
                               int64_t num_rows, int size, float eps, uint16_t *out,
                               int64_t out_stride, uint16_t *summed, int64_t summed_stride,
                               int num_threads) {
    if (size <= 0 || size % LANES || num_rows < 0 || (residual && !summed)) return -1;
    const int parallel = num_rows * (int64_t)size >= PARALLEL_MIN_ELEMENTS && num_threads > 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t r = 0; r < num_rows; r++) {
        const uint16_t *row = x + r * x_stride;
        const uint16_t *added = residual ? residual + r * residual_stride : NULL;
        uint16_t *sum_row = residual ? summed + r * summed_stride : NULL;
        const uint16_t *normed = residual ? sum_row : row;
        uint16_t *dst = out + r * out_stride;
        vf8 acc = splat(0.0f);
        for (int i = 0; i < size; i += LANES) {
            vf8 s = load_bf16(row + i);
            if (added) {
                s = round_to_bf16(s + load_bf16(added + i));
                store_bf16(sum_row + i, s);
            }
            acc += s * s;
        }
        const vf8 scale = splat(1.0f / sqrtf(hsum(acc) / (float)size + eps));
        for (int i = 0; i < size; i += LANES)
            store_bf16(dst + i, load_bf16(weight + i) * round_to_bf16(load_bf16(normed + i) * scale));
    }
    return 0;
}
