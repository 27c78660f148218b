/*
 * FP8 linears for CPU worker processes, as FP8 checkpoints run them: weights e4m3 with a scale
 * per block of input features (Qwen3-FP8's 128 x 128 blocks, or one block a row for per-channel
 * and per-tensor scales), activations rounded to e4m3 at every matmul with their own dynamic
 * scales (per 128 features of a token, per token, or per tensor). x float32 [M, K], out [M, N].
 *
 * Built on first use by worker/layers/quantization/fp8_kernel.py (through worker/native.py) and
 * loaded with ctypes. Every e4m3 value is a bfloat16 value (3 mantissa bits within 7, exponents
 * 2^-9 .. 2^8 within bfloat16's range), so the weights are stored once, at load time, as the
 * bfloat16 of their codes (2 bytes a weight, half of float32's) and the activations' codes
 * (rounded by the caller exactly as the torch path rounds them) go in as bfloat16 too: each
 * VDPBF16PS multiplies 2 pairs exactly and adds them in float32, 32 products an instruction
 * where float32's FMA does 16. Per block of input features the tile sums the codes' products,
 * then adds sum * x_scale * w_scale into the row's total: the torch path's
 * fake-quantized x @ dequantized W^T up to float rounding (the products here are exact, the
 * scales applied once per block rather than folded into every element).
 *
 * Panels of PANEL output columns: [ceil(N / PANEL)][K / 2][PANEL][2] bfloat16, a column's
 * features 2i and 2i + 1 in one 32-bit lane, the layout VDPBF16PS reads.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define CONVEYOR_FP8_GEMM_ABI_VERSION 1

int conveyor_fp8_gemm_abi_version(void) { return CONVEYOR_FP8_GEMM_ABI_VERSION; }

#if defined(__AVX512BF16__)
#define VL 16
#define NV 4
#define PANEL (VL * NV)
#define MR 6
#define MB 96
#define PREFETCH_BYTES 2048 /* as the int8 kernel: the weights' stream, 2 KB ahead */
#define PARALLEL_MIN_MACS (1 << 18)

int conveyor_fp8_available(void) { return 1; }

int conveyor_fp8_panel_width(void) { return PANEL; }

/* total[r] += (sum over the block's features of x codes * w codes) * x_scale[r] * w_scale, for
 * ROWS rows; x: bfloat16 pairs [rows][K / 2] (32-bit words), panel: the block's [count / 2]
 * [PANEL] pairs. */
static inline __attribute__((always_inline)) void fp8_rows_block(
    const uint32_t *x, int64_t x_stride, const uint32_t *panel, int64_t pairs, const int ROWS,
    const float *x_scale, int64_t x_scale_stride, const float *w_scale, float *total) {
    __m512 acc[MR][NV];
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; i++) {
        const uint32_t *w_i = panel + i * PANEL;
        __m512bh w[NV];
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) {
            __builtin_prefetch((const char *)(w_i + j * VL) + PREFETCH_BYTES, 0, 3);
            w[j] = (__m512bh)_mm512_loadu_si512(w_i + j * VL);
        }
#pragma GCC unroll 6
        for (int r = 0; r < ROWS; r++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[r * x_stride + i]);
#pragma GCC unroll 4
            for (int j = 0; j < NV; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, w[j]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; r++) {
        const __m512 xs = _mm512_set1_ps(x_scale[r * x_scale_stride]);
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) {
            float *t = total + r * PANEL + j * VL;
            const __m512 scaled = _mm512_mul_ps(_mm512_mul_ps(acc[r][j], xs),
                                                _mm512_loadu_ps(w_scale + j * VL));
            _mm512_storeu_ps(t, _mm512_add_ps(_mm512_loadu_ps(t), scaled));
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

/* out [M, N] = sum over blocks b of (codes(x)_b @ codes(W)_b^T) * x_scale[:, b] * w_scale[:, b]
 * + bias. x_codes: float32 [M, K] (row stride x_stride) already on e4m3's grid; x_scale
 * [M][K / block] float32; packed: the panels above; w_scale [ceil(N / PANEL)][K / block]
 * [PANEL] float32; bias [N] or NULL. block: even and dividing K. Returns -2 if memory ran
 * out. */
int conveyor_fp8_linear(const float *x_codes, int64_t x_stride, const float *x_scale,
                        int64_t m_size, int64_t k_size, const uint32_t *packed,
                        const float *w_scale, const float *bias, int64_t n_size, int64_t block,
                        float *out, int64_t out_stride, int num_threads) {
    if (m_size < 0 || k_size <= 0 || n_size <= 0 || num_threads < 1 || block <= 0 ||
        block % 2 || k_size % block)
        return -1;
    if (m_size == 0) return 0;
    const int64_t num_blocks_k = k_size / block, pairs = k_size / 2;
    /* x's codes as bfloat16 pairs: exact, every e4m3 value being a bfloat16 one. */
    uint32_t *x = malloc((size_t)(m_size * pairs) * sizeof(uint32_t));
    if (x == NULL) return -2;
    for (int64_t m = 0; m < m_size; m++) {
        const float *row = x_codes + m * x_stride;
        uint16_t *dest = (uint16_t *)(x + m * pairs);
        int64_t k = 0;
        for (; k + 16 <= k_size; k += 16)
            _mm256_storeu_si256((__m256i *)(dest + k),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + k)));
        for (; k < k_size; k++) {
            uint32_t bits;
            memcpy(&bits, row + k, sizeof bits);
            dest[k] = (uint16_t)(bits >> 16); /* exact: the low half is zero on e4m3's grid */
        }
    }
    const int64_t num_panels = (n_size + PANEL - 1) / PANEL;
    const int64_t num_row_blocks = (m_size + MB - 1) / MB;
    const int parallel = num_threads > 1 && m_size * n_size * k_size >= PARALLEL_MIN_MACS &&
                         num_panels * num_row_blocks > 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t item = 0; item < num_panels * num_row_blocks; item++) {
        float total[MR * PANEL] __attribute__((aligned(64)));
        const int64_t p = item / num_row_blocks, m_end = (item % num_row_blocks + 1) * MB;
        const uint32_t *panel = packed + p * pairs * PANEL;
        const int64_t n0 = p * PANEL;
        const int width = n_size - n0 < PANEL ? (int)(n_size - n0) : PANEL;
        for (int64_t r0 = (item % num_row_blocks) * MB; r0 < m_end && r0 < m_size; r0 += MR) {
            const int rows = m_size - r0 < MR ? (int)(m_size - r0) : MR;
            memset(total, 0, sizeof total);
            for (int64_t b = 0; b < num_blocks_k; b++) {
                const uint32_t *xb = x + r0 * pairs + b * (block / 2);
                const uint32_t *pb = panel + b * (block / 2) * PANEL;
                const float *xs = x_scale + r0 * num_blocks_k + b;
                const float *ws = w_scale + (p * num_blocks_k + b) * PANEL;
#define ROWS(R) fp8_rows_block(xb, pairs, pb, block / 2, R, xs, num_blocks_k, ws, total)
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
    free(x);
    return 0;
}
#else
int conveyor_fp8_available(void) { return 0; }

int conveyor_fp8_panel_width(void) { return 64; }

int conveyor_fp8_linear(const float *x_codes, int64_t x_stride, const float *x_scale,
                        int64_t m_size, int64_t k_size, const uint32_t *packed,
                        const float *w_scale, const float *bias, int64_t n_size, int64_t block,
                        float *out, int64_t out_stride, int num_threads) {
    (void)x_codes, (void)x_stride, (void)x_scale, (void)m_size, (void)k_size, (void)packed;
    (void)w_scale, (void)bias, (void)n_size, (void)block, (void)out, (void)out_stride;
    (void)num_threads;
    return -3;
}
#endif
