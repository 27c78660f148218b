/*
 * AMX tiles for the bfloat16 build's query-tile path (query_tiles.h, 16-float row vectors): the
 * two products of a key tile, scores and weighted values, as bfloat16 tile multiplies with
 * float32 accumulation (TDPBF16PS, 16x16 float32 results of 32-long bfloat16 dot products),
 * where the FMA path widens every element to float32 and multiplies one row vector at a time.
 *
 * Built where the compiler targets AMX-BF16 and AVX512-BF16 (-march=native on such a host) in the
 * CONVEYOR_BF16 build; used only once Linux has granted this process the tile data state
 * (conveyor_amx_enable: arch_prctl ARCH_REQ_XCOMP_PERM, which a kernel before 5.16 refuses), and
 * for head dims that are a multiple of 32. The layouts keep the query-tile path's own:
 *
 *   scores   s^T [keys x rows]  = K [keys x dims] . Q^T [dims x rows]: K's rows come straight
 *            from the cache (16 consecutive keys of one block are 16 rows at the head-dim
 *            stride), Q^T is packed once per query tile into the pair-interleaved ("VNNI") form
 *            the B operand takes; the result lands in s[t][v] as it is, rows in the lanes.
 *   values   o^T [dims x rows] += V^T [dims x keys] . P^T [keys x rows]: V^T is the tile's values
 *            transposed (16x16 dword transposes of key pairs), P^T the weights s[t][v] rounded to
 *            bfloat16 and interleaved by key pairs; the result accumulates in ot[d][v] as it is.
 *
 * So the online softmax, masks, windows, sinks and soft-caps between the products are the FMA
 * path's code unchanged. What differs from the float32 arithmetic: the products of bfloat16
 * inputs are exact either way, but the weights are rounded to bfloat16 before the second product
 * (at most 2^-8 of each weight, as flash attention's bfloat16 kernels round them), and the dot
 * products sum in another order.
 */
#ifndef CONVEYOR_AMX_TILES_H
#define CONVEYOR_AMX_TILES_H

#include "amx_permission.h" /* worker/csrc, through -I */

#if defined(CONVEYOR_BF16) && defined(CONVEYOR_AMX_BUILT)
#define CONVEYOR_AMX 1

/* 1 once this process may use the tiles and wants them (conveyor_amx_enable), else 0. */
static int amx_ready = 0;

/* Every tile this path uses is 16 rows of 64 bytes: C (16x16 float32) in 0-3, one per row vector,
 * A (16 rows of 32 bfloat16) in 4, B (16 pair-rows of 16x2 bfloat16) in 5. Loaded at the start
 * of every query tile: oneDNN's matmuls on the same threads load their own configuration between
 * our calls. */
static inline void amx_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 6; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    amx_load_config(&cfg);
}

/* Transpose 16 rows of 16 dwords in place (r[i][j] -> r[j][i]): 32-bit unpacks within 128-bit
 * lanes, then 64-bit ones, then two rounds of 128-bit lane shuffles. */
static inline __attribute__((always_inline)) void amx_transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* u[4i + m], lane k: rows 4i..4i+3 of column 4k + m. */
    for (int m = 0; m < 4; m++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88);
        const __m512i v1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xDD);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xDD);
        r[m] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[8 + m] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[4 + m] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* Two rows of 16 float32 rounded to bfloat16 and interleaved: (lo[0], hi[0], lo[1], hi[1], ...),
 * one row of a B operand (a pair of keys for 16 query rows). */
static inline __attribute__((always_inline)) __m512i amx_interleave_bf16(__m512 lo, __m512 hi) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
#endif

/* Whether the AMX path runs: 1 if asked for (want), built, and granted by the OS; else 0. */
int conveyor_amx_enable(int want) {
#ifdef CONVEYOR_AMX
    amx_ready = amx_permission(want);
    return amx_ready;
#else
    (void)want;
    return 0;
#endif
}

#endif /* CONVEYOR_AMX_TILES_H */
