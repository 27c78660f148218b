/*
 * The LoRA correction of one adapted linear, for every adapter of a step in one call, for CPU
 * worker processes: out[t] += B_s (A_s x[t]) for each token t run under the adapter in slot s
 * (B already scaled). Punica and S-LoRA call the pair "shrink" (x to the rank) and "expand" (the
 * rank to the outputs), grouped by segment: the step's tokens sorted by slot, one run per slot.
 *
 * Built on first use by worker/lora/kernel.py (through worker/native.py) and loaded with ctypes.
 * The torch form is two matmuls per adapter per layer; at decode each is a few rows, so the step
 * paid a call and an OpenMP fork and barrier per matmul (64 per adapter per step on the bench
 * model). Here one parallel region does all segments: the shrinks split by row tiles, one
 * barrier, then the expands split by panels of output columns (each thread reads only its
 * columns of every slot's B, and no two threads write the same element).
 *
 * A fused layer (q/k/v, gate/up) holds each part's A in its own rank columns and each part's B
 * in its own rank rows and output columns, zero elsewhere. The torch form multiplies the zeros
 * too; here each part's expand touches only its own output columns (a third of qkv's B, half of
 * gate_up's) and only the rank rows its adapter uses (a rank-8 adapter in rank-64 slots reads an
 * eighth).
 *
 * Layouts: A^T [slots][K][W] and B [slots][W][N] with W = parts * max_rank, both contiguous
 * along the rank / output columns, so both products are "rows of a left matrix times a row-major
 * right one": a tile holds MR rows by NV vectors of output columns in registers and, for each
 * k, broadcasts the left element and adds it times the right row's vectors. float32 or bfloat16
 * activations (x and out) and weights, float32 accumulation; the shrunk rows stay float32, and a
 * bfloat16 out is rounded once, to nearest even. The torch form rounds the shrunk rows to
 * bfloat16 too, so bfloat16 results differ from it by bfloat16 rounding, float32 ones by float
 * rounding (summation order).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "panel_tiles.h" /* worker/csrc, through -I: DISPATCH_ROWS */

#define CONVEYOR_LORA_SGMV_ABI_VERSION 1

/* A tile is MR rows by NV vectors of output columns: MR * NV accumulators, NV right-hand
 * vectors and a broadcast fit the registers (32 with AVX-512, 16 with AVX2). Six rows reuse each
 * loaded (and, in bfloat16, widened) weight vector six times. */
#if defined(__AVX512F__)
#define VL 16
#define NV 4
#else
#define VL 8
#define NV 2
#endif
#define PANEL (VL * NV)
#define MR 6
/* Below this many multiply-adds the fork costs more than a second thread saves. */
#define PARALLEL_MIN_MACS (1 << 16)

typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
/* Eight lanes: the column tail of an AVX-512 build (a rank-8 part is one of these). */
typedef float vf8 __attribute__((vector_size(32)));
typedef uint32_t vu8 __attribute__((vector_size(32)));
typedef uint16_t vh8 __attribute__((vector_size(16)));

int conveyor_lora_sgmv_abi_version(void) { return CONVEYOR_LORA_SGMV_ABI_VERSION; }

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

static inline float load1(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store1(void *p, int64_t i, float v, const int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = float_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* Vector load and store of LANES floats at p[i] in float32 or bfloat16, for both widths. The
 * bfloat16 store rounds to nearest even (finite values: the weights and activations here). */
#define VECTOR_IO(VF, VU, VH, SUFFIX)                                                  \
    static inline VF load##SUFFIX(const void *p, int64_t i, const int bf16) {          \
        VF v;                                                                          \
        if (bf16) {                                                                    \
            VH h;                                                                      \
            memcpy(&h, (const uint16_t *)p + i, sizeof h);                             \
            VU bits = __builtin_convertvector(h, VU) << 16;                            \
            memcpy(&v, &bits, sizeof v);                                               \
        } else {                                                                       \
            memcpy(&v, (const float *)p + i, sizeof v);                                \
        }                                                                              \
        return v;                                                                      \
    }                                                                                  \
    static inline void store##SUFFIX(void *p, int64_t i, VF v, const int bf16) {       \
        if (bf16) {                                                                    \
            VU bits;                                                                   \
            memcpy(&bits, &v, sizeof bits);                                            \
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;                         \
            VH h = __builtin_convertvector(bits, VH);                                  \
            memcpy((uint16_t *)p + i, &h, sizeof h);                                   \
        } else {                                                                       \
            memcpy((float *)p + i, &v, sizeof v);                                      \
        }                                                                              \
    }

VECTOR_IO(vf, vu, vh, _v)
VECTOR_IO(vf8, vu8, vh8, _v8)

/* One product: c[i][col] (+)= sum over k < k_count of l[i][k] * r[k * r_stride + col] for the
 * rows i < rows; l and c are row pointers (a segment's rows of x or out, in any order). Each
 * operand is float32 or bfloat16 (l_bf16, r_bf16, c_bf16). */
typedef struct {
    const void *l[MR];
    void *c[MR];
    int rows;
    const void *r;
    int64_t r_stride, k_count;
    int accumulate;
} Product;

/* Columns [col, col + NVEC * LANES) of the product's rows, in registers over all of k. */
#define TILE(VF, LANES, SUFFIX)                                                              \
    static inline __attribute__((always_inline)) void tile##SUFFIX(                          \
        const Product *p, int64_t col, const int ROWS, const int NVEC, const int l_bf16,     \
        const int r_bf16, const int c_bf16) {                                                \
        VF acc[MR][NV];                                                                      \
        _Pragma("GCC unroll 6") for (int i = 0; i < ROWS; i++)                               \
            _Pragma("GCC unroll 4") for (int j = 0; j < NVEC; j++) acc[i][j] =               \
                p->accumulate ? load##SUFFIX(p->c[i], col + j * LANES, c_bf16) : (VF){0};    \
        for (int64_t k = 0; k < p->k_count; k++) {                                           \
            VF rv[NV];                                                                       \
            const int64_t at = k * p->r_stride + col;                                        \
            _Pragma("GCC unroll 4") for (int j = 0; j < NVEC; j++) rv[j] =                   \
                load##SUFFIX(p->r, at + j * LANES, r_bf16);                                  \
            _Pragma("GCC unroll 6") for (int i = 0; i < ROWS; i++) {                         \
                const VF lv = load1(p->l[i], k, l_bf16) - (VF){0};                           \
                _Pragma("GCC unroll 4") for (int j = 0; j < NVEC; j++) acc[i][j] += lv * rv[j]; \
            }                                                                                \
        }                                                                                    \
        _Pragma("GCC unroll 6") for (int i = 0; i < ROWS; i++)                               \
            _Pragma("GCC unroll 4") for (int j = 0; j < NVEC; j++)                           \
                store##SUFFIX(p->c[i], col + j * LANES, acc[i][j], c_bf16);                  \
    }

TILE(vf, VL, _v)
TILE(vf8, 8, _v8)

static inline __attribute__((always_inline)) void tile_scalar(const Product *p, int64_t col,
                                                               const int l_bf16,
                                                               const int r_bf16,
                                                               const int c_bf16) {
    for (int i = 0; i < p->rows; i++) {
        float acc = p->accumulate ? load1(p->c[i], col, c_bf16) : 0.0f;
        for (int64_t k = 0; k < p->k_count; k++)
            acc += load1(p->l[i], k, l_bf16) * load1(p->r, k * p->r_stride + col, r_bf16);
        store1(p->c[i], col, acc, c_bf16);
    }
}

/* The product's columns [c0, c1): whole tiles, then single vectors, eight lanes, scalars. */
static inline __attribute__((always_inline)) void product_columns(const Product *p, int64_t c0,
                                                                   int64_t c1, const int l_bf16,
                                                                   const int r_bf16,
                                                                   const int c_bf16) {
    int64_t col = c0;
    for (; col + PANEL <= c1; col += PANEL) {
#define CALL(R) tile_v(p, col, R, NV, l_bf16, r_bf16, c_bf16)
        DISPATCH_ROWS(p->rows, CALL)
#undef CALL
    }
    for (; col + VL <= c1; col += VL) {
#define CALL(R) tile_v(p, col, R, 1, l_bf16, r_bf16, c_bf16)
        DISPATCH_ROWS(p->rows, CALL)
#undef CALL
    }
#if VL > 8
    for (; col + 8 <= c1; col += 8) {
#define CALL(R) tile_v8(p, col, R, 1, l_bf16, r_bf16, c_bf16)
        DISPATCH_ROWS(p->rows, CALL)
#undef CALL
    }
#endif
    for (; col < c1; col++) tile_scalar(p, col, l_bf16, r_bf16, c_bf16);
}

/* What every item of one call reads. */
typedef struct {
    const char *x, *a_t, *b;
    char *out;
    float *shrunk, *x_rows; /* x_rows: MR * K floats per thread, for widened bfloat16 rows */
    int64_t x_stride, out_stride, act_size, weight_size;
    const int64_t *token_rows, *segments, *part_cols, *segment_offsets;
    int64_t offset, num_segments, k_size, n_size, max_rank, width;
    const int32_t *ranks;
    int num_parts;
} Call;

static inline int thread_index(void) {
#if defined(_OPENMP)
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int64_t token_row(const Call *c, int64_t i) {
    return c->token_rows ? c->token_rows[i] : c->offset + i;
}

/* Shrink MR (or fewer) tokens of one segment: shrunk[i][part's rank columns] = x[row] A_p^T.
 * Parts that use the slots' whole rank run into the next part's columns, and adjacent ranges
 * are one product (more vectors per tile). bfloat16 rows are widened into x_rows first (MR * K
 * floats of this thread's), once, not at every broadcast. */
static inline __attribute__((always_inline)) void shrink_rows(const Call *c, int64_t segment,
                                                               int64_t i0, float *x_rows,
                                                               const int act_bf16,
                                                               const int w_bf16) {
    const int64_t slot = c->segments[3 * segment], end = c->segments[3 * segment + 2];
    Product p = {.rows = end - i0 < MR ? (int)(end - i0) : MR, .r_stride = c->width,
                 .k_count = c->k_size, .accumulate = 0,
                 .r = c->a_t + slot * c->k_size * c->width * c->weight_size};
    for (int i = 0; i < p.rows; i++) {
        const char *row = c->x + token_row(c, i0 + i) * c->x_stride * c->act_size;
        if (act_bf16) {
            float *widened = x_rows + i * c->k_size;
            for (int64_t k = 0; k < c->k_size; k++)
                widened[k] = bf16_to_float(((const uint16_t *)row)[k]);
            p.l[i] = widened;
        } else {
            p.l[i] = row;
        }
        p.c[i] = c->shrunk + (i0 + i) * c->width;
    }
    int64_t lo = 0, hi = 0; /* the pending range of rank columns */
    for (int part = 0; part <= c->num_parts; part++) {
        const int rank = part < c->num_parts ? c->ranks[slot * c->num_parts + part] : 0;
        const int64_t first = part * c->max_rank;
        if (rank > 0 && first == hi) {
            hi = first + rank;
            continue;
        }
        if (hi > lo) product_columns(&p, lo, hi, 0, w_bf16, 0);
        lo = first;
        hi = first + (rank > 0 ? rank : 0);
    }
}

/* Ask for rows [0, rows) of bytes [0, bytes) of a matrix whose rows are stride bytes apart. In
 * a decode step B arrives cold (the base layer's weights went through the caches since), and a
 * panel's rows lie an output row apart; asking for the next panel's while this one runs made a
 * bench-model layer's four adapted linears 1.03-1.07x faster in float32 and 1.06-1.47x in
 * bfloat16 at 1-16 adapters, one core (`python -m benchmarks lora-kernel
 * --compare-build=-DPREFETCH_B=0`); two panels ahead measured the same as one (0.90-1.08x in
 * either direction between runs). PREFETCH_B: panels asked for ahead. */
static inline void prefetch_rows(const char *p, int rows, int64_t stride, int64_t bytes) {
    for (int k = 0; k < rows; k++)
        for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + k * stride + at, 0, 3);
}

#ifndef PREFETCH_B
#define PREFETCH_B 1
#endif

/* Expand every segment into output columns [n0, n1): out[row][n] += shrunk[i] B_p[:, n] for
 * the parts whose columns meet the panel. */
static inline __attribute__((always_inline)) void expand_panel(const Call *c, int64_t n0,
                                                                int64_t n1, const int act_bf16,
                                                                const int w_bf16) {
    for (int64_t segment = 0; segment < c->num_segments; segment++) {
        const int64_t slot = c->segments[3 * segment];
        const int64_t start = c->segments[3 * segment + 1], end = c->segments[3 * segment + 2];
        const char *b = c->b + slot * c->width * c->n_size * c->weight_size;
        for (int part = 0; part < c->num_parts; part++) {
            const int rank = c->ranks[slot * c->num_parts + part];
            const int64_t lo = c->part_cols[part] > n0 ? c->part_cols[part] : n0;
            const int64_t hi = c->part_cols[part + 1] < n1 ? c->part_cols[part + 1] : n1;
            if (rank <= 0 || lo >= hi) continue;
            const int64_t first = part * c->max_rank;
            Product p = {.r = b + first * c->n_size * c->weight_size, .r_stride = c->n_size,
                         .k_count = rank, .accumulate = 1};
            for (int ahead = 0; ahead < PREFETCH_B; ahead++) {
                const int64_t next = n1 + ahead * PANEL;
                if (next < c->part_cols[part + 1])
                    prefetch_rows((const char *)p.r + next * c->weight_size, rank,
                                  c->n_size * c->weight_size, PANEL * c->weight_size);
            }
            for (int64_t i0 = start; i0 < end; i0 += MR) {
                p.rows = end - i0 < MR ? (int)(end - i0) : MR;
                for (int i = 0; i < p.rows; i++) {
                    p.l[i] = c->shrunk + (i0 + i) * c->width + first;
                    p.c[i] = c->out + token_row(c, i0 + i) * c->out_stride * c->act_size;
                }
                product_columns(&p, lo, hi, 0, w_bf16, act_bf16);
            }
        }
    }
}

/* The shrink items are (segment, MR-row tile) pairs in segment order: item -> segment by a
 * binary search over the segments' first items. */
static inline int64_t segment_of_item(const Call *c, int64_t item) {
    int64_t lo = 0, hi = c->num_segments - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (c->segment_offsets[mid] <= item)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* What each thread of the team does: its share of the shrinks, then of the expands. The dtype
 * flags are constants in each caller below (OpenMP outlines a parallel region before the
 * inliner runs, so the region sits in each specialised caller, not here). */
static inline __attribute__((always_inline)) void run_in_team(const Call *c, int64_t num_items,
                                                               const int act_bf16,
                                                               const int w_bf16) {
    float *x_rows = act_bf16 ? c->x_rows + thread_index() * MR * c->k_size : NULL;
    const int64_t num_panels = (c->n_size + PANEL - 1) / PANEL;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < num_items; item++) {
        const int64_t segment = segment_of_item(c, item);
        const int64_t i0 =
            c->segments[3 * segment + 1] + (item - c->segment_offsets[segment]) * MR;
        shrink_rows(c, segment, i0, x_rows, act_bf16, w_bf16);
    }
    /* The implicit barrier above is the call's one wait: every shrunk row is ready. */
#pragma omp for schedule(static)
    for (int64_t panel = 0; panel < num_panels; panel++) {
        const int64_t n0 = panel * PANEL;
        expand_panel(c, n0, n0 + PANEL < c->n_size ? n0 + PANEL : c->n_size, act_bf16, w_bf16);
    }
}

#define RUN(ACT_BF16, W_BF16)                                                                  \
    static void run_##ACT_BF16##_##W_BF16(const Call *c, int64_t num_items, int num_threads,    \
                                          int parallel) {                                       \
        _Pragma("omp parallel num_threads(num_threads) if (parallel)")                          \
            run_in_team(c, num_items, ACT_BF16, W_BF16);                                        \
    }

RUN(0, 0)
RUN(0, 1)
RUN(1, 0)
RUN(1, 1)

/* out[token_rows[i]] += B_s (A_s x[token_rows[i]]) for every token i of every segment
 * (slot s, start, end): segments in order, covering tokens [0, total); token_rows NULL means
 * row offset + i. x [rows][k_size] and out [rows][n_size] (row strides in elements) are
 * float32 or bfloat16 (act_bf16); a_t [slots][k_size][W] and b [slots][W][n_size], W =
 * num_parts * max_rank, float32 or bfloat16 (weight_bf16); ranks [slots][num_parts]: the rank
 * columns each slot's part uses (0: none); part_cols [num_parts + 1]: each part's first output
 * column, then n_size. Returns 0, -1 for bad sizes, -2 when out of memory. */
int conveyor_lora_add(const void *x, int64_t x_stride, void *out, int64_t out_stride,
                      int act_bf16, const int64_t *token_rows, int64_t offset,
                      const int64_t *segments, int64_t num_segments, const void *a_t,
                      const void *b, int weight_bf16, const int32_t *ranks,
                      const int64_t *part_cols, int num_parts, int64_t max_rank, int64_t k_size,
                      int64_t n_size, int num_threads) {
    if (num_segments < 0 || num_parts < 1 || max_rank < 1 || k_size < 1 || n_size < 1 ||
        num_threads < 1)
        return -1;
    if (num_segments == 0) return 0;
    const int64_t num_tokens = segments[3 * num_segments - 1];
    int64_t *segment_offsets = malloc(sizeof(int64_t) * num_segments);
    float *shrunk = malloc(sizeof(float) * num_tokens * num_parts * max_rank);
    float *x_rows = act_bf16 ? malloc(sizeof(float) * num_threads * MR * k_size) : NULL;
    if (!segment_offsets || !shrunk || (act_bf16 && !x_rows)) {
        free(segment_offsets);
        free(shrunk);
        free(x_rows);
        return -2;
    }
    int64_t num_items = 0, macs = 0;
    for (int64_t s = 0; s < num_segments; s++) {
        const int64_t rows = segments[3 * s + 2] - segments[3 * s + 1];
        segment_offsets[s] = num_items;
        num_items += (rows + MR - 1) / MR;
        for (int part = 0; part < num_parts; part++)
            macs += rows * ranks[segments[3 * s] * num_parts + part] *
                    (k_size + part_cols[part + 1] - part_cols[part]);
    }
    const Call call = {
        .x = x, .a_t = a_t, .b = b, .out = out, .shrunk = shrunk, .x_rows = x_rows,
        .x_stride = x_stride, .out_stride = out_stride,
        .act_size = act_bf16 ? 2 : 4, .weight_size = weight_bf16 ? 2 : 4,
        .token_rows = token_rows, .segments = segments, .part_cols = part_cols,
        .segment_offsets = segment_offsets, .offset = offset, .num_segments = num_segments,
        .k_size = k_size, .n_size = n_size, .max_rank = max_rank,
        .width = num_parts * max_rank, .ranks = ranks, .num_parts = num_parts,
    };
    const int parallel = num_threads > 1 && macs >= PARALLEL_MIN_MACS;
    switch ((act_bf16 ? 2 : 0) + (weight_bf16 ? 1 : 0)) {
        case 0: run_0_0(&call, num_items, num_threads, parallel); break;
        case 1: run_0_1(&call, num_items, num_threads, parallel); break;
        case 2: run_1_0(&call, num_items, num_threads, parallel); break;
        default: run_1_1(&call, num_items, num_threads, parallel); break;
    }
    free(segment_offsets);
    free(shrunk);
    free(x_rows);
    return 0;
}
