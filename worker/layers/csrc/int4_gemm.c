/*
 * Weight-only 4-bit linears for CPU worker processes: out = x @ W^T + bias with W's 4-bit codes
 * u, one scale s and zero z per group of input features and output column:
 * W[n][k] = (u[n][k] - z[n][g]) * s[n][g], g = k / group_size. x float32 [M, K], out [M, N].
 *
 * Built on first use by worker/layers/quantization/int4_kernel.py (through worker/native.py)
 * and loaded with ctypes. The codes are stored once, at load time, in panels of PANEL output
 * columns; within a panel, for each run of 8 input features, one 32-bit word per column holds
 * the column's 8 codes (feature 8o + s in bits 4s..4s+3). A vector of words then serves 8
 * features of VL consecutive columns, and a code becomes a float with no shuffle: shifted and
 * masked into the low bits of 2^23's bit pattern it reads as 2^23 + u, and subtracting the
 * group's 2^23 + z leaves u - z exactly. Widening bytes into lanes (vpmovzxbd) runs on one
 * port of an AVX-512 core, and a 4-bit kernel built on it ran no faster than the int8 one at
 * one row on the 2-core Xeon; shift, mask-and-or (one vpternlogd) and subtract run on two.
 * Per group the tile sums x * (u - z) in registers, then adds acc * s. A decode step reads each
 * code once: half of int8's bytes, an eighth of float32's. With AVX-512 a shifted word indexes
 * a 16-float table of u - 8 instead (one permute, which reads each lane's low 4 bits: two
 * instructions per 16 codes where the bit trick takes three), and the zero comes off once per
 * group: sum x (u - 8) - (z - 8) sum x (1.02-1.03x on Qwen3-0.6B's decoder linears streamed
 * from memory; docs/performance.md).
 *
 * At hundreds of rows (a prefill chunk), unpacking every code once per 6-row tile costs more than
 * unpacking it once and running a float GEMM, so conveyor_int4_dequantize_t writes W^T in float32
 * for a matmul library to multiply them by (worker/layers/quantization/int4_kernel.py picks by
 * the row count).
 *
 * Summation order differs from x @ dequantize(W)^T in float32 (per group, then scaled), so the
 * results differ by float rounding (relative ~K * 2^-24).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif


#define CONVEYOR_INT4_GEMM_ABI_VERSION 4

#if defined(__AVX512F__)
#define VL 16
#define NV 4
#else
#define VL 8
#define NV 2
#endif
#define PANEL (VL * NV)
#define CODES_PER_WORD 8
#define MR 6
#define MB 96
#define PARALLEL_MIN_MACS (1 << 18)

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

/* 2^23 as a float's bits: with a code in the low mantissa bits it reads 2^23 + code. */
#define MAGIC_BITS 0x4B000000
#define MAGIC_FLOAT 8388608.0f

static inline vf loadf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storef(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf splat(float x) { return x - (vf){0}; }

static inline vi loadi(const uint32_t *p) {
    vi v;
    memcpy(&v, p, sizeof v);
    return v;
}

int conveyor_int4_gemm_abi_version(void) { return CONVEYOR_INT4_GEMM_ABI_VERSION; }

int conveyor_int4_panel_width(void) { return PANEL; }

int conveyor_int4_vector_widening(void) {
#if defined(__AVX512F__) || defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* total[r] += (sum over the group's k of x[r][k] * (u[k] - z)) * s, for ROWS rows; words:
 * the group's [k_count / 8][PANEL] code words, zero_offset: 2^23 + z per column; group_sum
 * (AVX-512 builds): row r's sum of x over the group at group_sum[r * sum_stride]. */
static inline __attribute__((always_inline)) void rows_group(
    const float *x, int64_t x_stride, const uint32_t *words, const float *zero_offset,
    int64_t k_count, const int ROWS, const float *scale, const float *group_sum,
    int64_t sum_stride, float *total /* [ROWS][PANEL] */) {
    vf acc[MR][NV], zoff[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; j++) zoff[j] = loadf(zero_offset + j * VL);
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) acc[r][j] = splat(0.0f);
#if defined(__AVX512F__)
    /* u - 8 for each code u: one permute of a 16-float table turns 16 codes into floats (it
     * reads only the low 4 bits of each lane, so no mask), where the bit trick below takes a
     * mask-and-or and a subtraction. The zero is then applied once per group and row:
     * sum x (u - z) = sum x (u - 8) - (z - 8) sum x, the same products for a symmetric code
     * (z = 8), the sums of x made once per call (conveyor_int4_linear), not per panel. */
    const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
#endif
    for (int64_t o = 0; o < k_count / CODES_PER_WORD; o++) {
        vi word[NV];
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) word[j] = loadi(words + o * PANEL + j * VL);
        const float *xo = x + o * CODES_PER_WORD;
#pragma GCC unroll 8
        for (int s = 0; s < CODES_PER_WORD; s++) {
            vf w[NV];
#pragma GCC unroll 4
            for (int j = 0; j < NV; j++)
#if defined(__AVX512F__)
                w[j] = (vf)_mm512_permutexvar_ps((__m512i)(word[j] >> (4 * s)), table);
#else
                w[j] = (vf)(((word[j] >> (4 * s)) & 0x0F) | MAGIC_BITS) - zoff[j];
#endif
#pragma GCC unroll 6
            for (int r = 0; r < ROWS; r++) {
                const vf xv = splat(xo[r * x_stride + s]);
#pragma GCC unroll 4
                for (int j = 0; j < NV; j++) acc[r][j] += xv * w[j];
            }
        }
    }
#if defined(__AVX512F__)
    /* zoff holds 2^23 + z: exactly z - 8 after the subtraction. */
    vf zero8[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; j++) zero8[j] = zoff[j] - splat(MAGIC_FLOAT + 8.0f);
#endif
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; r++) {
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) {
            float *t = total + r * PANEL + j * VL;
#if defined(__AVX512F__)
            const vf sum = acc[r][j] - zero8[j] * splat(group_sum[r * sum_stride]);
#else
            const vf sum = acc[r][j];
#endif
            storef(t, loadf(t) + sum * loadf(scale + j * VL));
        }
    }
}

#define DISPATCH_ROWS(rows, CALL) \
    switch (rows) {               \
        case 1: CALL(1); break;   \
        case 2: CALL(2); break;   \
        case 3: CALL(3); break;   \
        case 4: CALL(4); break;   \
        case 5: CALL(5); break;   \
        default: CALL(6); break;  \
    }

/* out [M, N] = x [M, K] @ W^T + bias. packed: [ceil(N / PANEL)][K / 8][PANEL] words; scale
 * and zero_offset (2^23 + z): [ceil(N / PANEL)][K / group_size][PANEL] floats; bias [N] (or
 * NULL). group_size divides K and is a multiple of 8. */
int conveyor_int4_linear(const float *x, int64_t x_stride, int64_t m_size, int64_t k_size,
                         const uint32_t *packed, const float *scale, const float *zero_offset,
                         const float *bias, int64_t n_size, int64_t group_size, float *out,
                         int64_t out_stride, int num_threads) {
    if (m_size < 0 || k_size <= 0 || n_size <= 0 || num_threads < 1 || group_size <= 0 ||
        k_size % group_size || group_size % CODES_PER_WORD)
        return -1;
    if (m_size == 0) return 0;
    const int64_t num_groups = k_size / group_size;
    const int64_t num_panels = (n_size + PANEL - 1) / PANEL;
    const int64_t num_blocks = (m_size + MB - 1) / MB;
    const int parallel = num_threads > 1 && m_size * n_size * k_size >= PARALLEL_MIN_MACS &&
                         num_panels * num_blocks > 1;
    float *group_sums = NULL;
#if defined(__AVX512F__)
    /* Each row's sum of x per group, for rows_group's zero term: once here for every panel. */
    group_sums = malloc((size_t)(m_size * num_groups) * sizeof(float));
    if (group_sums == NULL) return -2;
    for (int64_t m = 0; m < m_size; m++)
        for (int64_t g = 0; g < num_groups; g++) {
            float sum = 0.0f;
            for (int64_t k = g * group_size; k < (g + 1) * group_size; k++)
                sum += x[m * x_stride + k];
            group_sums[m * num_groups + g] = sum;
        }
#endif
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t item = 0; item < num_panels * num_blocks; item++) {
        float total[MR * PANEL] __attribute__((aligned(64)));
        const int64_t p = item / num_blocks, m_end = (item % num_blocks + 1) * MB;
        const uint32_t *panel = packed + p * (k_size / CODES_PER_WORD) * PANEL;
        const float *panel_scale = scale + p * num_groups * PANEL;
        const float *panel_zoff = zero_offset + p * num_groups * PANEL;
        const int64_t n0 = p * PANEL;
        const int width = n_size - n0 < PANEL ? (int)(n_size - n0) : PANEL;
        for (int64_t r0 = (item % num_blocks) * MB; r0 < m_end && r0 < m_size; r0 += MR) {
            const int rows = m_size - r0 < MR ? (int)(m_size - r0) : MR;
            memset(total, 0, sizeof total);
            for (int64_t g = 0; g < num_groups; g++) {
                const float *xr = x + r0 * x_stride + g * group_size;
                const uint32_t *words = panel + g * (group_size / CODES_PER_WORD) * PANEL;
                const float *s = panel_scale + g * PANEL, *z = panel_zoff + g * PANEL;
                const float *sums = group_sums ? group_sums + r0 * num_groups + g : NULL;
#define ROWS(R) rows_group(xr, x_stride, words, z, group_size, R, s, sums, num_groups, total)
                DISPATCH_ROWS(rows, ROWS)
#undef ROWS
            }
            for (int r = 0; r < rows; r++) {
                float *o = out + (r0 + r) * out_stride + n0;
                for (int n = 0; n < width; n++)
                    o[n] = total[r * PANEL + n] + (bias ? bias[n0 + n] : 0.0f);
            }
        }
    }
    free(group_sums);
    return 0;
}

/* out [K, N] = W^T in float32, (u - z) * s per weight, from the same panels: vectors of VL
 * columns, the conversion of the matmul above, stored instead of multiplied. */
int conveyor_int4_dequantize_t(const uint32_t *packed, const float *scale,
                               const float *zero_offset, int64_t n_size, int64_t k_size,
                               int64_t group_size, float *out, int num_threads) {
    if (k_size <= 0 || n_size <= 0 || num_threads < 1 || group_size <= 0 ||
        k_size % group_size || group_size % CODES_PER_WORD)
        return -1;
    const int64_t num_groups = k_size / group_size;
    const int64_t num_panels = (n_size + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t p = 0; p < num_panels; p++) {
        const uint32_t *panel = packed + p * (k_size / CODES_PER_WORD) * PANEL;
        const int64_t n0 = p * PANEL;
        const int width = n_size - n0 < PANEL ? (int)(n_size - n0) : PANEL;
        for (int64_t g = 0; g < num_groups; g++) {
            vf zoff[NV], sc[NV];
            for (int j = 0; j < NV; j++) {
                zoff[j] = loadf(zero_offset + (p * num_groups + g) * PANEL + j * VL);
                sc[j] = loadf(scale + (p * num_groups + g) * PANEL + j * VL);
            }
            const int64_t o_end = (g + 1) * group_size / CODES_PER_WORD;
            for (int64_t o = g * group_size / CODES_PER_WORD; o < o_end; o++) {
                vi word[NV];
                for (int j = 0; j < NV; j++) word[j] = loadi(panel + o * PANEL + j * VL);
                for (int s = 0; s < CODES_PER_WORD; s++) {
                    float *row = out + (o * CODES_PER_WORD + s) * n_size + n0;
                    for (int j = 0; j < NV; j++) {
                        const vf w =
                            ((vf)(((word[j] >> (4 * s)) & 0x0F) | MAGIC_BITS) - zoff[j]) * sc[j];
                        if (width == PANEL) {
                            storef(row + j * VL, w);
                        } else {
                            float lanes[VL];
                            storef(lanes, w);
                            for (int c = j * VL; c < width && c < (j + 1) * VL; c++)
                                row[c] = lanes[c - j * VL];
                        }
                    }
                }
            }
        }
    }
    return 0;
}
