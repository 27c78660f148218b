/*
 * Weight-only 4-bit linears for CPU worker processes: out = x @ W^T + bias with W's 4-bit codes
 * u, one scale s and zero z per group of input features and output column:
 * W[n][k] = (u[n][k] - z[n][g]) * s[n][g], g = k / group_size. x float32 [M, K], out [M, N].
 *
 * Built on first use by worker/layers/quantization/int4_kernel.py (through worker/native.py)
 * and loaded with ctypes. The codes are stored once, at load time, in panels of PANEL output
 * columns; within a panel, for each run of 8 input features, one 32-bit word per column holds
 * the column's 8 codes: feature 8o + 2i in bits 4i..4i+3 and feature 8o + 2i + 1 in bits
 * 4i+16..4i+19 (i < 4), so that a word shifted right by 4i holds features 2i and 2i + 1 in the
 * low bits of its two 16-bit halves (the AMX path below reads them as one pair). A vector of
 * words then serves 8 features of VL consecutive columns, and a code becomes a float with no shuffle: shifted and
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

#include "amx_permission.h" /* worker/csrc, through -I */
#include "panel_tiles.h"

#define CONVEYOR_INT4_GEMM_ABI_VERSION 5

#if defined(__AVX512F__)
#define VL 16
#define NV 4
#else
#define VL 8
#define NV 2
#endif
#define PANEL (VL * NV)
#define CODES_PER_WORD 8
/* The input feature (of a word's 8) whose code sits in bits 4q..4q+3. */
#define FEATURE_AT(q) (2 * ((q) % 4) + (q) / 4)
#define MR TILE_ROWS
#define MB ITEM_ROWS
/* How far ahead of its reads the tile asks for code words and for a group's scales and zeros.
 * The hardware prefetchers alone left one row's tile reading 12-14 GB/s of a host's 28 (2-core
 * AMX Xeon, Qwen3-0.6B's decoder linears streamed from memory, 2 threads); asking 2 KB ahead
 * into every cache level took it to 16.5-17.5 (nearer, farther or non-temporal: slower). */
#define TILE_PREFETCH_WORDS 512
#define GROUP_PREFETCH 1

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
        for (int j = 0; j < NV; j++) {
            __builtin_prefetch(words + o * PANEL + TILE_PREFETCH_WORDS + j * VL, 0, 3);
            word[j] = loadi(words + o * PANEL + j * VL);
        }
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
                const vf xv = splat(xo[r * x_stride + FEATURE_AT(s)]);
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


/* 1 unless the sizes make sense: groups that divide K and are a multiple of `multiple`. */
static int bad_shapes(int64_t m_size, int64_t k_size, int64_t n_size, int64_t group_size,
                      int64_t multiple, int num_threads) {
    return m_size < 0 || k_size <= 0 || n_size <= 0 || num_threads < 1 || group_size <= 0 ||
           k_size % group_size || group_size % multiple;
}

/* out [M, N] = x [M, K] @ W^T + bias. packed: [ceil(N / PANEL)][K / 8][PANEL] words; scale
 * and zero_offset (2^23 + z): [ceil(N / PANEL)][K / group_size][PANEL] floats; bias [N] (or
 * NULL). group_size divides K and is a multiple of 8. */
int conveyor_int4_linear(const float *x, int64_t x_stride, int64_t m_size, int64_t k_size,
                         const uint32_t *packed, const float *scale, const float *zero_offset,
                         const float *bias, int64_t n_size, int64_t group_size, float *out,
                         int64_t out_stride, int num_threads) {
    if (bad_shapes(m_size, k_size, n_size, group_size, CODES_PER_WORD, num_threads)) return -1;
    if (m_size == 0) return 0;
    const int64_t num_groups = k_size / group_size;
    const int64_t num_panels = (n_size + PANEL - 1) / PANEL;
    const int64_t num_blocks = (m_size + MB - 1) / MB;
    const int parallel =
        panel_parallel(m_size, n_size, k_size, num_panels * num_blocks, num_threads);
    float *group_sums = NULL;
#if defined(__AVX512F__)
    /* rows_group's zero term: (z - 8) times each row's sum of x over the group. */
    group_sums = panel_group_sums(x, x_stride, m_size, k_size, group_size);
    if (group_sums == NULL) return -2;
#endif
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t item = 0; item < num_panels * num_blocks; item++) {
        float total[MR * PANEL] __attribute__((aligned(64)));
        const int64_t p = item / num_blocks, m_end = (item % num_blocks + 1) * MB;
        const uint32_t *panel = packed + p * (k_size / CODES_PER_WORD) * PANEL;
        const float *panel_scale = scale + p * num_groups * PANEL;
        const float *panel_zoff = zero_offset + p * num_groups * PANEL;
        const int64_t n0 = p * PANEL;
        for (int64_t r0 = (item % num_blocks) * MB; r0 < m_end && r0 < m_size; r0 += MR) {
            const int rows = m_size - r0 < MR ? (int)(m_size - r0) : MR;
            memset(total, 0, sizeof total);
            for (int64_t g = 0; g < num_groups; g++) {
                const float *xr = x + r0 * x_stride + g * group_size;
                const uint32_t *words = panel + g * (group_size / CODES_PER_WORD) * PANEL;
                const float *s = panel_scale + g * PANEL, *z = panel_zoff + g * PANEL;
                const float *sums = group_sums ? group_sums + r0 * num_groups + g : NULL;
                for (int j = 0; j < NV; j++) {
                    __builtin_prefetch(s + GROUP_PREFETCH * PANEL + j * VL, 0, 3);
                    __builtin_prefetch(z + GROUP_PREFETCH * PANEL + j * VL, 0, 3);
                }
#define ROWS(R) rows_group(xr, x_stride, words, z, group_size, R, s, sums, num_groups, total)
                DISPATCH_ROWS(rows, ROWS)
#undef ROWS
            }
            panel_write_rows(total, PANEL, rows, n0, n_size, bias, out + r0 * out_stride,
                             out_stride);
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
                    float *row = out + (o * CODES_PER_WORD + FEATURE_AT(s)) * n_size + n0;
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

/*
 * Many rows on AMX (a host with AMX-BF16, once Linux granted the tile state): the codes of a
 * panel are unpacked once per call into u - z as bfloat16 (small whole numbers, exact), laid out
 * as the B operand of TDPBF16PS (pairs of consecutive input features per column), and x's rows
 * multiply them as 16x16 float32 tiles of 32-long dot products. x goes in as three bfloat16
 * parts, x = hi + mid + lo (each the rounding of what the parts before it left; together they
 * hold float32's 24 significant bits), three A operands multiplied by the same B into the same
 * accumulator, so every product with a code is exact and the sums run in float32, as the float
 * kernel's do, in another order. Per group the four C tiles of a panel are stored and added to
 * the rows' totals scaled by s.
 *
 * A panel's codes are unpacked AMX_SPAN features at a time (16 KB of B operands, in L1 while
 * every tile of rows multiplies them); x's parts for AMX_CHUNK_BYTES of rows stay in L2 while
 * every panel passes. Cost per weight: one unpacking per chunk of rows (where the 6-row tile
 * above unpacks once per 6 rows) and three tile products per 16 rows. A row's result depends on
 * that row alone, whatever rows share the call and however many threads run it.
 *
 * Up to 6 rows (one pass of the tile above, which prefetches) the tile is faster: AMX took
 * 0.76-0.95x its speed on the 2-core Xeon's decoder linears from memory at 2-6 rows, 1.02-1.27x
 * at 7-8, so int4_kernel.py calls this from 7 rows (AMX_MIN_ROWS).
 */
#if defined(CONVEYOR_AMX_BUILT)
#define AMX_PARTS 3  /* bfloat16 parts of each float32 of x */
#define AMX_K 32     /* bfloat16 input features of a tile product */
#define AMX_SPAN 128 /* features of a panel unpacked at a time */
#define AMX_CHUNK_BYTES (1 << 20)
#define AMX_PREFETCH_SPANS 4

static int int4_amx_ready = 0;

/* Whether conveyor_int4_linear_amx runs: 1 if asked for, built and granted; else 0. */
int conveyor_int4_amx_enable(int want) {
    int4_amx_ready = amx_permission(want);
    return int4_amx_ready;
}

/* Tiles 0-3: C, `rows` rows x 16 columns of float32, one per 16 of the panel's 64 columns; 4-6:
 * A, the three parts of `rows` rows x 32 features; 7: B, 16 pairs of features x 16 columns. */
static inline void int4_amx_configure(int rows) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = i == 7 ? 16 : rows;
    }
    amx_load_config(&cfg);
}

/* Features [k0, k0 + count) of the panel's codes as B operands: b [4 column blocks][count / 2
 * pairs][16 columns] 32-bit pairs, u - 8 of feature 2p in the low half, of 2p + 1 in the high
 * half (the zero comes off per group in the sums). A word shifted right by 4p holds the pair's
 * two codes in the low bits of its halves; VPERMW reads the low five bits of each half as an
 * index into a 32-entry table of bfloat16 (u - 8) (entries i and i + 16 alike, so the fifth
 * bit, the next code's, does not matter): a shift and a permute per 32 codes. */
static void int4_amx_unpack(const uint32_t *panel, int64_t k0, int64_t count, uint32_t *b) {
    /* bfloat16 of -8 .. 7 (a float's upper half), twice. */
    const __m512i table = _mm512_set_epi16(
        0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, (short)0xBF80,
        (short)0xC000, (short)0xC040, (short)0xC080, (short)0xC0A0, (short)0xC0C0,
        (short)0xC0E0, (short)0xC100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80,
        0x0000, (short)0xBF80, (short)0xC000, (short)0xC040, (short)0xC080, (short)0xC0A0,
        (short)0xC0C0, (short)0xC0E0, (short)0xC100);
    for (int j = 0; j < NV; j++) {
        const uint32_t *words = panel + (k0 / CODES_PER_WORD) * PANEL + j * VL;
        uint32_t *dest = b + j * (count / 2) * VL;
        for (int64_t o = 0; o < count / CODES_PER_WORD; o++) {
            const __m512i word = _mm512_loadu_si512(words + o * PANEL);
#pragma GCC unroll 4
            for (int p = 0; p < CODES_PER_WORD / 2; p++)
                _mm512_storeu_si512(dest + (o * (CODES_PER_WORD / 2) + p) * VL,
                                    _mm512_permutexvar_epi16(_mm512_srli_epi32(word, 4 * p),
                                                             table));
        }
    }
}

/* A thread's start in a parallel region: its B operand buffer (AMX_SPAN features of a panel)
 * and, if totals_size, a float buffer of that many for the rows' totals, its tiles configured
 * for `rows` rows. NULL (both freed, *failed set) if memory ran out: the thread then skips its
 * panels, and the call reports it. */
static uint32_t *int4_amx_thread_start(int rows, int64_t totals_size, float **totals,
                                       int *failed) {
    uint32_t *b = aligned_alloc(64, (size_t)(AMX_SPAN / 2 * PANEL) * sizeof(uint32_t));
    if (b != NULL && totals_size) {
        *totals = aligned_alloc(64, (size_t)totals_size * sizeof(float));
        if (*totals == NULL) {
            free(b);
            b = NULL;
        }
    }
    if (b == NULL) {
#pragma omp atomic write
        *failed = 1;
        return NULL;
    }
    int4_amx_configure(rows);
    return b;
}

/* The four C tiles (16 columns each) side by side into c [rows][PANEL]. */
static inline void int4_amx_store_c(float *c) {
    _tile_stored(0, c, PANEL * 4);
    _tile_stored(1, c + VL, PANEL * 4);
    _tile_stored(2, c + 2 * VL, PANEL * 4);
    _tile_stored(3, c + 3 * VL, PANEL * 4);
}

/* Asks for the codes AMX_PREFETCH_SPANS spans ahead of [k0, k0 + span) (past the panel's end,
 * the next panel's, which the same thread most often takes next; past the last panel, nothing:
 * a prefetch never faults): between unpackings the tile
 * products leave the memory idle, where the 6-row tile's loads stream all along. From memory at
 * 1-4 rows this took a linear from 0.73-0.93x of the 6-row tile's speed to 0.95-1.23x. */
static inline void int4_amx_prefetch(const uint32_t *panel, int64_t k0, int64_t span) {
    const char *ahead =
        (const char *)(panel + (k0 + AMX_PREFETCH_SPANS * span) / CODES_PER_WORD * PANEL);
    for (int64_t offset = 0; offset < span / CODES_PER_WORD * PANEL * 4; offset += 64)
        _mm_prefetch(ahead + offset, _MM_HINT_T0);
}

/* One row x [K] split into its AMX_PARTS bfloat16 parts: part t of features 32b .. 32b + 31 at
 * dest + b * block_stride + t * part_stride (the A operands' layout is the caller's); sums
 * [K / span]: the row's sum of x over each span of features (for the zero term). */
static void int4_amx_split_row(const float *xr, int64_t k_size, int64_t span, float *sums,
                               uint16_t *dest, int64_t block_stride, int64_t part_stride) {
    for (int64_t k0 = 0; k0 < k_size; k0 += span) {
        float sum = 0.0f;
        for (int64_t k = k0; k < k0 + span; k++) sum += xr[k];
        sums[k0 / span] = sum;
    }
    for (int64_t k = 0; k < k_size; k += 16) {
        __m512 rest = _mm512_loadu_ps(xr + k);
        uint16_t *block = dest + (k / AMX_K) * block_stride + k % AMX_K;
        for (int t = 0; t < AMX_PARTS; t++) {
            const __m256bh part = _mm512_cvtneps_pbh(rest);
            _mm256_storeu_si256((__m256i *)(block + t * part_stride), (__m256i)part);
            /* What the part left: exact in float32 (the part is rest's rounding). */
            rest = _mm512_sub_ps(rest, _mm512_cvtpbh_ps(part));
        }
    }
}

/* x's rows [m0, m0 + rows) as A operands: a [ceil(rows / tile_rows)][K / 32][3 parts]
 * [tile_rows][32] bfloat16 (an operand is one contiguous block, which a tile load reads as
 * consecutive cache lines); the rows past the last are zero. span_sums [rows][K / span]: each
 * row's sum of x over each span of features (for the zero term). */
static void int4_amx_split(const float *x, int64_t x_stride, int64_t m0, int64_t rows,
                           int tile_rows, int64_t k_size, int64_t span, uint16_t *a,
                           float *span_sums) {
    const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
    const int64_t operand = (int64_t)tile_rows * AMX_K, tile_size = AMX_PARTS * k_size * tile_rows;
    memset(a, 0, (size_t)(tiles * tile_size) * sizeof(uint16_t));
    for (int64_t r = 0; r < rows; r++)
        int4_amx_split_row(x + (m0 + r) * x_stride, k_size, span,
                           span_sums + r * (k_size / span),
                           a + (r / tile_rows) * tile_size + (r % tile_rows) * AMX_K,
                           AMX_PARTS * operand, operand);
}

/* out [M, N] = x [M, K] @ W^T + bias as conveyor_int4_linear computes it (same arguments),
 * through AMX tiles; group_size a multiple of 32 and PANEL 64. Returns -3 where the AMX path
 * is not enabled (the caller runs conveyor_int4_linear instead), -2 if memory ran out. */
int conveyor_int4_linear_amx(const float *x, int64_t x_stride, int64_t m_size, int64_t k_size,
                             const uint32_t *packed, const float *scale, const float *zero_offset,
                             const float *bias, int64_t n_size, int64_t group_size, float *out,
                             int64_t out_stride, int num_threads) {
    if (bad_shapes(m_size, k_size, n_size, group_size, AMX_K, num_threads)) return -1;
    if (!int4_amx_ready) return -3;
    if (m_size == 0) return 0;
    const int64_t num_groups = k_size / group_size;
    const int64_t num_panels = (n_size + PANEL - 1) / PANEL;
    /* Features unpacked at a time: within one group, at most AMX_SPAN. */
    int64_t span = group_size;
    while (span > AMX_SPAN && span % 2 == 0 && (span / 2) % AMX_K == 0) span /= 2;
    if (span > AMX_SPAN) span = AMX_K;
    /* Fewer than 16 rows: tiles of just those rows (a product's time follows its rows). */
    const int tile_rows = m_size < 16 ? (int)m_size : 16;
    int64_t chunk = AMX_CHUNK_BYTES / (k_size * 2 * AMX_PARTS) / tile_rows * tile_rows;
    if (chunk < tile_rows) chunk = tile_rows;
    if (chunk > m_size) chunk = m_size;
    const int64_t chunk_tiles = (chunk + tile_rows - 1) / tile_rows;
    const int64_t tile_size = AMX_PARTS * k_size * tile_rows, operand = tile_rows * AMX_K;
    uint16_t *a = aligned_alloc(64, (size_t)(chunk_tiles * tile_size) * 2);
    float *span_sums = malloc((size_t)(chunk * (k_size / span)) * sizeof(float));
    if (a == NULL || span_sums == NULL) {
        free(a);
        free(span_sums);
        return -2;
    }
    int failed = 0;
    for (int64_t m0 = 0; m0 < m_size && !failed; m0 += chunk) {
        const int64_t rows = m_size - m0 < chunk ? m_size - m0 : chunk;
        const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
        int4_amx_split(x, x_stride, m0, rows, tile_rows, k_size, span, a, span_sums);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_panels > 1)
        {
            float *totals = NULL;
            uint32_t *b = int4_amx_thread_start(tile_rows, tiles * tile_rows * PANEL, &totals,
                                                &failed);
            float c[16 * PANEL] __attribute__((aligned(64)));
#pragma omp for schedule(static)
            for (int64_t p = 0; p < num_panels; p++) {
                if (b == NULL) continue;
                const uint32_t *panel = packed + p * (k_size / CODES_PER_WORD) * PANEL;
                memset(totals, 0, (size_t)(tiles * tile_rows * PANEL) * sizeof(float));
                for (int64_t k0 = 0; k0 < k_size; k0 += span) {
                    const int64_t g = k0 / group_size;
                    int4_amx_prefetch(panel, k0, span);
                    int4_amx_unpack(panel, k0, span, b);
                    const float *s = scale + (p * num_groups + g) * PANEL;
                    const float *zoff = zero_offset + (p * num_groups + g) * PANEL;
                    for (int64_t t = 0; t < tiles; t++) {
                        const uint16_t *at = a + t * tile_size + (k0 / AMX_K) * AMX_PARTS * operand;
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                        for (int64_t k = 0; k < span; k += AMX_K) {
                            const uint16_t *ak = at + (k / AMX_K) * AMX_PARTS * operand;
                            const uint32_t *bk = b + (k / 2) * VL;
                            _tile_loadd(4, ak, AMX_K * 2);
                            _tile_loadd(5, ak + operand, AMX_K * 2);
                            _tile_loadd(6, ak + 2 * operand, AMX_K * 2);
#define COLUMNS(C)                                            \
    _tile_loadd(7, bk + (C) * (span / 2) * VL, VL * 4);        \
    _tile_dpbf16ps(C, 4, 7);                                  \
    _tile_dpbf16ps(C, 5, 7);                                  \
    _tile_dpbf16ps(C, 6, 7);
                            COLUMNS(0)
                            COLUMNS(1)
                            COLUMNS(2)
                            COLUMNS(3)
#undef COLUMNS
                        }
                        int4_amx_store_c(c);
                        /* totals += s * (sum x (u - 8) - (z - 8) sum x); zoff is 2^23 + z. */
                        float *tt = totals + t * tile_rows * PANEL;
                        const float *sums = span_sums + t * tile_rows * (k_size / span) + k0 / span;
                        const int last = rows - t * tile_rows < tile_rows
                                             ? (int)(rows - t * tile_rows) : tile_rows;
                        for (int j = 0; j < NV; j++) {
                            const __m512 sj = _mm512_loadu_ps(s + j * VL);
                            const __m512 zj = _mm512_sub_ps(_mm512_loadu_ps(zoff + j * VL),
                                                            _mm512_set1_ps(MAGIC_FLOAT + 8.0f));
                            for (int i = 0; i < last; i++) {
                                float *out_ij = tt + i * PANEL + j * VL;
                                const __m512 dot = _mm512_fnmadd_ps(
                                    zj, _mm512_set1_ps(sums[i * (k_size / span)]),
                                    _mm512_load_ps(c + i * PANEL + j * VL));
                                _mm512_store_ps(out_ij, _mm512_fmadd_ps(dot, sj,
                                                                        _mm512_load_ps(out_ij)));
                            }
                        }
                    }
                }
                panel_write_rows(totals, PANEL, rows, p * PANEL, n_size, bias,
                                 out + m0 * out_stride, out_stride);
            }
            if (b != NULL) _tile_release();
            free(b);
            free(totals);
        }
    }
    free(a);
    free(span_sums);
    return failed ? -2 : 0;
}
#else
int conveyor_int4_amx_enable(int want) {
    (void)want;
    return 0;
}

int conveyor_int4_linear_amx(const float *x, int64_t x_stride, int64_t m_size, int64_t k_size,
                             const uint32_t *packed, const float *scale, const float *zero_offset,
                             const float *bias, int64_t n_size, int64_t group_size, float *out,
                             int64_t out_stride, int num_threads) {
    (void)x, (void)x_stride, (void)m_size, (void)k_size, (void)packed, (void)scale;
    (void)zero_offset, (void)bias, (void)n_size, (void)group_size, (void)out, (void)out_stride;
    (void)num_threads;
    return -3;
}
#endif
