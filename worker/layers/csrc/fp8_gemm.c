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
 * (rounded here exactly as the torch path rounds them: fp8_round) go in as bfloat16 too: each
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

#include "amx_permission.h" /* worker/csrc, through -I */
#include "panel_tiles.h"

#define CONVEYOR_FP8_GEMM_ABI_VERSION 3

int conveyor_fp8_gemm_abi_version(void) { return CONVEYOR_FP8_GEMM_ABI_VERSION; }

#if defined(__AVX512BF16__)
#define VL 16
#define NV 4
#define PANEL (VL * NV)
#define MR TILE_ROWS
#define MB ITEM_ROWS
#define PREFETCH_BYTES 2048 /* as the int8 kernel: the weights' stream, 2 KB ahead */
/* From this many rows the AMX path runs where it can (docs/performance.md, "FP8 on CPU"). */
#ifndef FP8_AMX_MIN_ROWS
#define FP8_AMX_MIN_ROWS 8
#endif

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


#define FP8_MAX 448.0f
#define FP8_TOKEN 0
#define FP8_TENSOR 1
#define FP8_GROUP 2

/* v / scale on e4m3's grid, as torch's x / scale, clamp to +-448 and cast to float8_e4m3fn
 * round: normal values keep 3 mantissa bits (to nearest, ties to even, a carry moving the
 * exponent up), those under 2^-6 (subnormal in e4m3) are whole multiples of 2^-9. */
static inline __m512 fp8_round(__m512 v, __m512 scale) {
    const __m512 limit = _mm512_set1_ps(FP8_MAX);
    v = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(v, scale), _mm512_sub_ps(_mm512_setzero_ps(),
                                                                           limit)), limit);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_and_si512(
        _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF), lsb)),
        _mm512_set1_epi32((int)0xFFF00000u));
    const __m512 sub = _mm512_mul_ps(
        _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(512.0f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
        _mm512_set1_ps(1.0f / 512.0f));
    const __mmask16 small = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(0x1p-6f),
                                               _CMP_LT_OQ);
    return _mm512_mask_blend_ps(small, _mm512_castsi512_ps(rounded), sub);
}

/* The torch path's scale of a max |x|: max / 448, the float32 epsilon where 0. */
static inline float fp8_scale(float abs_max) {
    const float scale = abs_max / FP8_MAX;
    return scale == 0.0f ? 1.1920928955078125e-07f : scale;
}

static float fp8_abs_max(const float *x, int64_t count) {
    __m512 m = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= count; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    if (k < count)
        m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_maskz_loadu_ps(
                                 (__mmask16)((1u << (count - k)) - 1), x + k)));
    return _mm512_reduce_max_ps(m);
}

/* x [M, K]'s e4m3 codes and scales as activations.quantize_activations makes them: strategy
 * FP8_TOKEN (a scale a row), FP8_TENSOR (one) or FP8_GROUP (one per `block` features of a row);
 * scales [M][K / block] (the same value repeated where the strategy has fewer); codes as
 * bfloat16 [M][K] (exact) and, if codes_out, as float32 too (for tests). block: K for
 * FP8_TOKEN and FP8_TENSOR. */
static void fp8_quantize(const float *x, int64_t x_stride, int64_t m_size, int64_t k_size,
                         int strategy, int64_t block, float *scales, uint16_t *codes,
                         float *codes_out) {
    const int64_t blocks = k_size / block;
    float whole = 0.0f;
    for (int64_t m = 0; m < m_size; m++)
        for (int64_t b = 0; b < blocks; b++) {
            const float a = fp8_abs_max(x + m * x_stride + b * block, block);
            scales[m * blocks + b] = a;
            whole = a > whole ? a : whole;
        }
    for (int64_t m = 0; m < m_size; m++) {
        const float *row = x + m * x_stride;
        for (int64_t b = 0; b < blocks; b++) {
            float *s = scales + m * blocks + b;
            *s = fp8_scale(strategy == FP8_TENSOR ? whole : *s);
            const __m512 scale = _mm512_set1_ps(*s);
            for (int64_t k = b * block; k < (b + 1) * block; k += 16) {
                const int64_t left = (b + 1) * block - k;
                const __mmask16 mask = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
                const __m512 q = fp8_round(_mm512_maskz_loadu_ps(mask, row + k), scale);
                _mm256_mask_storeu_epi16(codes + m * k_size + k, mask,
                                         (__m256i)_mm512_cvtneps_pbh(q));
                if (codes_out) _mm512_mask_storeu_ps(codes_out + m * k_size + k, mask, q);
            }
        }
    }
}

/* For tests: x's codes (float32 [M][K]) and scales ([M][K / block]) as the linear below rounds
 * them. Returns -1 for sizes that do not fit. */
int conveyor_fp8_quantize(const float *x, int64_t x_stride, int64_t m_size, int64_t k_size,
                          int strategy, int64_t block, float *codes_out, float *scales) {
    if (m_size <= 0 || k_size <= 0 || block <= 0 || k_size % block) return -1;
    uint16_t *codes = malloc((size_t)(m_size * k_size) * sizeof(uint16_t));
    if (codes == NULL) return -2;
    fp8_quantize(x, x_stride, m_size, k_size, strategy, block, scales, codes, codes_out);
    free(codes);
    return 0;
}

#if defined(CONVEYOR_AMX_BUILT)
/*
 * Many rows on AMX tiles: the panels are already TDPBF16PS's B operand (16 pairs of features
 * x 16 columns a tile, rows PANEL words apart) and x's bfloat16 codes its A operand (16 rows x
 * 32 features), so nothing is unpacked: per block of input features four C tiles (the panel's
 * 64 columns) sum the products, then each row's sums are scaled into its totals as above.
 */
#define FP8_AMX_K 32 /* bfloat16 features of a tile product */
#define FP8_AMX_ROWS 16

static int fp8_amx_ready = 0;

/* Whether conveyor_fp8_linear uses AMX from FP8_AMX_MIN_ROWS rows: asked for, built, granted. */
int conveyor_fp8_amx_enable(int want) {
    fp8_amx_ready = amx_permission(want);
    return fp8_amx_ready;
}

/* Tiles 0-3: C, 16 rows x 16 float32; 4: A, 16 rows x 32 bfloat16; 5: B, 16 pairs x 16. */
static void fp8_amx_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 6; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = FP8_AMX_ROWS;
    }
    amx_load_config(&cfg);
}

/* The AMX form of the tile loop: x as bfloat16 pairs [rows padded to 16][K / 2] (the padding
 * rows zero), scales and the rest as conveyor_fp8_linear's. */
static void fp8_amx_linear(const uint32_t *x, const float *x_scale, int64_t m_size,
                           int64_t k_size, const uint32_t *packed, const float *w_scale,
                           const float *bias, int64_t n_size, int64_t block, float *out,
                           int64_t out_stride, int num_threads) {
    const int64_t num_blocks_k = k_size / block, pairs = k_size / 2;
    const int64_t num_panels = (n_size + PANEL - 1) / PANEL;
    const int64_t tiles = (m_size + FP8_AMX_ROWS - 1) / FP8_AMX_ROWS;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_panels > 1)
    {
        fp8_amx_configure();
        float c[FP8_AMX_ROWS * PANEL] __attribute__((aligned(64)));
        float total[FP8_AMX_ROWS * PANEL] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < num_panels; p++) {
            const uint32_t *panel = packed + p * pairs * PANEL;
            const int64_t n0 = p * PANEL;
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t r0 = t * FP8_AMX_ROWS;
                const int rows = m_size - r0 < FP8_AMX_ROWS ? (int)(m_size - r0) : FP8_AMX_ROWS;
                memset(total, 0, sizeof total);
                for (int64_t b = 0; b < num_blocks_k; b++) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t k0 = b * block; k0 < (b + 1) * block; k0 += FP8_AMX_K) {
                        const uint32_t *bk = panel + (k0 / 2) * PANEL;
                        _tile_loadd(4, x + r0 * pairs + k0 / 2, pairs * 4);
                        _tile_loadd(5, bk, PANEL * 4);
                        _tile_dpbf16ps(0, 4, 5);
                        _tile_loadd(5, bk + VL, PANEL * 4);
                        _tile_dpbf16ps(1, 4, 5);
                        _tile_loadd(5, bk + 2 * VL, PANEL * 4);
                        _tile_dpbf16ps(2, 4, 5);
                        _tile_loadd(5, bk + 3 * VL, PANEL * 4);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                    _tile_stored(0, c, PANEL * 4);
                    _tile_stored(1, c + VL, PANEL * 4);
                    _tile_stored(2, c + 2 * VL, PANEL * 4);
                    _tile_stored(3, c + 3 * VL, PANEL * 4);
                    const float *ws = w_scale + (p * num_blocks_k + b) * PANEL;
                    for (int r = 0; r < rows; r++) {
                        const __m512 xs = _mm512_set1_ps(x_scale[(r0 + r) * num_blocks_k + b]);
                        for (int j = 0; j < NV; j++) {
                            float *tj = total + r * PANEL + j * VL;
                            const __m512 scaled =
                                _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(c + r * PANEL + j * VL),
                                                            xs),
                                              _mm512_loadu_ps(ws + j * VL));
                            _mm512_store_ps(tj, _mm512_add_ps(_mm512_load_ps(tj), scaled));
                        }
                    }
                }
                panel_write_rows(total, PANEL, rows, n0, n_size, bias, out + r0 * out_stride,
                                 out_stride);
            }
        }
        _tile_release();
    }
}
#else
int conveyor_fp8_amx_enable(int want) {
    (void)want;
    return 0;
}
#endif

/* out [M, N] = sum over blocks b of (codes(x)_b @ codes(W)_b^T) * x_scale[:, b] * w_scale[:, b]
 * + bias, x float32 [M, K] (row stride x_stride) rounded to e4m3 here with the strategy's
 * dynamic scales (fp8_quantize); packed: the panels above; w_scale [ceil(N / PANEL)][K / block]
 * [PANEL] float32; bias [N] or NULL. block: even and dividing K (the activations' group for
 * FP8_GROUP, else K). Returns -2 if memory ran out. */
int conveyor_fp8_linear(const float *x_in, int64_t x_stride, int strategy, int64_t m_size,
                        int64_t k_size, const uint32_t *packed, const float *w_scale,
                        const float *bias, int64_t n_size, int64_t block, float *out,
                        int64_t out_stride, int num_threads) {
    if (m_size < 0 || k_size <= 0 || n_size <= 0 || num_threads < 1 || block <= 0 ||
        block % 2 || k_size % block || (strategy != FP8_GROUP && block != k_size))
        return -1;
    if (m_size == 0) return 0;
    const int64_t num_blocks_k = k_size / block, pairs = k_size / 2;
    /* Rows padded with zeros to whole AMX tiles (the AMX path reads 16 rows at a time). */
    const int64_t padded_rows = (m_size + 15) / 16 * 16;
    uint32_t *x = calloc((size_t)(padded_rows * pairs), sizeof(uint32_t));
    float *x_scale = malloc((size_t)(m_size * num_blocks_k) * sizeof(float));
    if (x == NULL || x_scale == NULL) {
        free(x);
        free(x_scale);
        return -2;
    }
    fp8_quantize(x_in, x_stride, m_size, k_size, strategy, block, x_scale, (uint16_t *)x, NULL);
#if defined(CONVEYOR_AMX_BUILT)
    if (fp8_amx_ready && m_size >= FP8_AMX_MIN_ROWS && block % FP8_AMX_K == 0) {
        fp8_amx_linear(x, x_scale, m_size, k_size, packed, w_scale, bias, n_size, block, out,
                       out_stride, num_threads);
        free(x);
        free(x_scale);
        return 0;
    }
#endif
    const int64_t num_panels = (n_size + PANEL - 1) / PANEL;
    const int64_t num_row_blocks = (m_size + MB - 1) / MB;
    const int parallel =
        panel_parallel(m_size, n_size, k_size, num_panels * num_row_blocks, num_threads);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t item = 0; item < num_panels * num_row_blocks; item++) {
        float total[MR * PANEL] __attribute__((aligned(64)));
        const int64_t p = item / num_row_blocks, m_end = (item % num_row_blocks + 1) * MB;
        const uint32_t *panel = packed + p * pairs * PANEL;
        const int64_t n0 = p * PANEL;
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
            panel_write_rows(total, PANEL, rows, n0, n_size, bias, out + r0 * out_stride,
                             out_stride);
        }
    }
    free(x);
    free(x_scale);
    return 0;
}
#else
int conveyor_fp8_available(void) { return 0; }

int conveyor_fp8_amx_enable(int want) {
    (void)want;
    return 0;
}

int conveyor_fp8_panel_width(void) { return 64; }

int conveyor_fp8_quantize(const float *x, int64_t x_stride, int64_t m_size, int64_t k_size,
                          int strategy, int64_t block, float *codes_out, float *scales) {
    (void)x, (void)x_stride, (void)m_size, (void)k_size, (void)strategy, (void)block;
    (void)codes_out, (void)scales;
    return -3;
}

int conveyor_fp8_linear(const float *x_in, int64_t x_stride, int strategy, int64_t m_size,
                        int64_t k_size, const uint32_t *packed, const float *w_scale,
                        const float *bias, int64_t n_size, int64_t block, float *out,
                        int64_t out_stride, int num_threads) {
    (void)x_in, (void)x_stride, (void)strategy, (void)m_size, (void)k_size, (void)packed;
    (void)w_scale, (void)bias, (void)n_size, (void)block, (void)out, (void)out_stride;
    (void)num_threads;
    return -3;
}
#endif
