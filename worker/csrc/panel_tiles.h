/*
 * What the compiled linears share (worker/layers/csrc/int8_gemm.c, int4_gemm.c, fp8_gemm.c;
 * lora_sgmv.c takes the row dispatch):
 * weights in panels of a fixed number of output columns, x's rows taken in register tiles of up
 * to 6 rows, one copy of a tile per row count chosen at run time, and each tile's float32 totals
 * written out with the bias. Found through -I, as amx_permission.h.
 */
#ifndef CONVEYOR_PANEL_TILES_H
#define CONVEYOR_PANEL_TILES_H

#include <stdint.h>
#include <stdlib.h>

/* Rows per register tile: 6 rows x 4 vectors of accumulators (24) leave AVX-512's 32 registers
 * room for the weights and a broadcast. */
#define TILE_ROWS 6
/* Rows per work item: a long prompt chunk splits into items of this many rows. */
#define ITEM_ROWS 96
/* Below this many multiply-adds the OpenMP fork costs more than the second thread saves. */
#define PANEL_PARALLEL_MIN_MACS (1 << 18)

/* One specialised copy per row count (CALL(R) with R a constant), chosen at run time. */
#define DISPATCH_ROWS(rows, CALL) \
    switch (rows) {               \
        case 1: CALL(1); break;   \
        case 2: CALL(2); break;   \
        case 3: CALL(3); break;   \
        case 4: CALL(4); break;   \
        case 5: CALL(5); break;   \
        default: CALL(6); break;  \
    }

/* Whether a call of these sizes, split into `items` work items, runs on several threads. */
static inline int panel_parallel(int64_t m_size, int64_t n_size, int64_t k_size, int64_t items,
                                 int num_threads) {
    return num_threads > 1 && m_size * n_size * k_size >= PANEL_PARALLEL_MIN_MACS && items > 1;
}

/* out's rows [0, rows), columns [n0, n0 + panel width clipped to N) = totals [rows][panel]
 * + bias (bias [N] or NULL). */
static inline void panel_write_rows(const float *totals, int64_t panel, int64_t rows,
                                    int64_t n0, int64_t n_size, const float *bias, float *out,
                                    int64_t out_stride) {
    const int64_t width = n_size - n0 < panel ? n_size - n0 : panel;
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + r * out_stride + n0;
        for (int64_t n = 0; n < width; n++)
            o[n] = totals[r * panel + n] + (bias ? bias[n0 + n] : 0.0f);
    }
}

/* Each row's sum of x over each group of `group_size` features, [M][K / group_size] (malloc'd,
 * NULL if memory ran out): the zero term of a group-wise linear, (z - 8) or z times the row's
 * sum, made once per call for every panel. */
static inline float *panel_group_sums(const float *x, int64_t x_stride, int64_t m_size,
                                      int64_t k_size, int64_t group_size) {
    const int64_t num_groups = k_size / group_size;
    float *sums = malloc((size_t)(m_size * num_groups) * sizeof(float));
    if (sums == NULL) return NULL;
    for (int64_t m = 0; m < m_size; m++)
        for (int64_t g = 0; g < num_groups; g++) {
            float sum = 0.0f;
            for (int64_t k = g * group_size; k < (g + 1) * group_size; k++)
                sum += x[m * x_stride + k];
            sums[m * num_groups + g] = sum;
        }
    return sums;
}

#endif /* CONVEYOR_PANEL_TILES_H */
