/*
 * Weight-only 4-bit linears for CPU worker processes: out = x @ W^T + bias with W's 4-bit codes
 * u, one scale s and zero z per group of input features and output column:
 * W[n][k] = (u[n][k] - z[n][g]) * s[n][g], g = k / group_size. x float32 [M, K], out [M, N].
 *
 * Built on first use by worker/layers/quantization/int4_kernel.py (through worker/native.py)
 * and loaded with ctypes. The codes are stored once, at load time, in panels of PANEL output
 * columns, k-major: for each k, PANEL / 2 bytes, byte i holding column i in its low nibble and
 * column i + PANEL / 2 in its high one, so one load, a mask and a shift give two runs of
 * consecutive columns. The zero points are integers (every format's are), stored as bytes per
 * group and column in the same order, so one byte subtraction per 16 weights gives u - z as a
 * signed byte, which widens exactly into floats; per group the tile sums x * (u - z) in
 * registers and then adds acc * s. Subtracting the zero before the products keeps the sums as
 * small as the result (subtracting z * sum(x) afterwards cancelled large terms and cost
 * precision). A decode step reads each code once: half of int8's bytes, an eighth of float32's.
 *
 * Summation order differs from x @ dequantize(W)^T in float32 (per group, then scaled), so the
 * results differ by float rounding (relative ~K * 2^-24).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define CONVEYOR_INT4_GEMM_ABI_VERSION 2

#if defined(__AVX512F__)
#define VL 16
#define NV 4
#else
#define VL 8
#define NV 2
#endif
#define PANEL (VL * NV)
#define HALF (PANEL / 2)
#define MR 6
#define MB 96
#define PARALLEL_MIN_MACS (1 << 18)

typedef float vf __attribute__((vector_size(VL * 4)));

static inline vf loadf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storef(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vf splat(float x) { return x - (vf){0}; }

/* One k's PANEL codes minus their zero codes (z: the group's PANEL zero bytes) -> NV float
 * vectors, columns in order. */
static inline void widen_codes(const uint8_t *p, const uint8_t *z, vf w[NV]) {
#if defined(__AVX512F__)
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(p + h * 16));
        const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        const __m128i zlo = _mm_loadu_si128((const __m128i *)(z + h * 16));
        const __m128i zhi = _mm_loadu_si128((const __m128i *)(z + HALF + h * 16));
        w[h] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(lo, zlo)));
        w[2 + h] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(hi, zhi)));
    }
#elif defined(__AVX2__)
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const __m128i zlo = _mm_loadl_epi64((const __m128i *)z);
    const __m128i zhi = _mm_loadl_epi64((const __m128i *)(z + HALF));
    w[0] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_sub_epi8(lo, zlo)));
    w[1] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_sub_epi8(hi, zhi)));
#else
    for (int j = 0; j < NV; j++)
        for (int i = 0; i < VL; i++) {
            const int col = j * VL + i;
            const uint8_t byte = p[col % HALF];
            w[j][i] = (float)((col < HALF ? byte & 0x0F : byte >> 4) - z[col]);
        }
#endif
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

/* total[r] += (sum over the group's k of x[r][k] * (u[k] - z)) * s, for ROWS rows. */
static inline __attribute__((always_inline)) void rows_group(
    const float *x, int64_t x_stride, const uint8_t *codes, const uint8_t *zeros,
    int64_t k_count, const int ROWS, const float *scale, float *total /* [ROWS][PANEL] */) {
    vf acc[MR][NV];
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) acc[r][j] = splat(0.0f);
    for (int64_t k = 0; k < k_count; k++) {
        vf w[NV];
        widen_codes(codes + k * HALF, zeros, w);
#pragma GCC unroll 6
        for (int r = 0; r < ROWS; r++) {
            const vf xv = splat(x[r * x_stride + k]);
#pragma GCC unroll 4
            for (int j = 0; j < NV; j++) acc[r][j] += xv * w[j];
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; r++) {
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) {
            float *t = total + r * PANEL + j * VL;
            storef(t, loadf(t) + acc[r][j] * loadf(scale + j * VL));
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

/* out [M, N] = x [M, K] @ W^T + bias. packed: [ceil(N / PANEL)][K][PANEL / 2] bytes; scale
 * [ceil(N / PANEL)][K / group_size][PANEL] floats and zeros the same in bytes (0-15); bias [N]
 * (or NULL). group_size divides K. */
int conveyor_int4_linear(const float *x, int64_t x_stride, int64_t m_size, int64_t k_size,
                         const uint8_t *packed, const float *scale, const uint8_t *zeros,
                         const float *bias, int64_t n_size, int64_t group_size, float *out,
                         int64_t out_stride, int num_threads) {
    if (m_size < 0 || k_size <= 0 || n_size <= 0 || num_threads < 1 || group_size <= 0 ||
        k_size % group_size)
        return -1;
    if (m_size == 0) return 0;
    const int64_t num_groups = k_size / group_size;
    const int64_t num_panels = (n_size + PANEL - 1) / PANEL;
    const int64_t num_blocks = (m_size + MB - 1) / MB;
    const int parallel = num_threads > 1 && m_size * n_size * k_size >= PARALLEL_MIN_MACS &&
                         num_panels * num_blocks > 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t item = 0; item < num_panels * num_blocks; item++) {
        float total[MR * PANEL] __attribute__((aligned(64)));
        const int64_t p = item / num_blocks, m_end = (item % num_blocks + 1) * MB;
        const uint8_t *panel = packed + p * k_size * HALF;
        const float *panel_scale = scale + p * num_groups * PANEL;
        const uint8_t *panel_zeros = zeros + p * num_groups * PANEL;
        const int64_t n0 = p * PANEL;
        const int width = n_size - n0 < PANEL ? (int)(n_size - n0) : PANEL;
        for (int64_t r0 = (item % num_blocks) * MB; r0 < m_end && r0 < m_size; r0 += MR) {
            const int rows = m_size - r0 < MR ? (int)(m_size - r0) : MR;
            memset(total, 0, sizeof total);
            for (int64_t g = 0; g < num_groups; g++) {
                const float *xr = x + r0 * x_stride + g * group_size;
                const uint8_t *codes = panel + g * group_size * HALF;
                const float *s = panel_scale + g * PANEL;
                const uint8_t *z = panel_zeros + g * PANEL;
#define ROWS(R) rows_group(xr, x_stride, codes, z, group_size, R, s, total)
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
    return 0;
}
