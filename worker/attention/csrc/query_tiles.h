/*
 * The paged-attention kernel's path for query tiles: up to TILE_MAX_ROWS query rows (a run of
 * consecutive tokens of one request, times the heads of one GQA group) against every key they
 * may see, read tile by tile straight from the paged cache. Included only by paged_attention.c.
 *
 * The rows are the vector lanes: queries are packed transposed once per item (qt[d] holds row
 * vectors), so a score tile is a small matrix product in which one key element, broadcast,
 * multiplies a vector of rows, with SCORE_KEYS x row-vector accumulators held in registers; the
 * weighted values likewise broadcast one value element against a vector of weights into a
 * transposed output (ot[d]). The online softmax then runs on row vectors too: a tile's max, the
 * rescale and the exp are vector operations per key, not per (row, key). Nothing larger than a
 * tile of scores (WIDE_TILE_KEYS x rows) is ever held, and K/V are never copied.
 *
 * Causal masking, sliding windows, sinks and the soft-cap follow the short path's rules
 * (short_queries.h); masking costs a compare per key only on the tiles a row's window edge or
 * the diagonal crosses.
 */
#ifndef CONVEYOR_QUERY_TILES_H
#define CONVEYOR_QUERY_TILES_H

#include "paged_kv.h"
#include "vector_math.h"

#define TILE_ROW_VECTORS 4
#define TILE_MAX_ROWS (TILE_ROW_VECTORS * LANES)
/* Keys per softmax update: its rescale of the output is amortised over this many keys, and the
 * tile's K/V rows (16 KiB at head_dim 64) stay in L1 between the two products. */
#define WIDE_TILE_KEYS 32
/* Register blocking of the two products: accumulators held in registers. With 32 vector
 * registers (AVX-512VL, NEON) 4 keys x 4 row vectors for the scores and 24 for the values fit,
 * leaving room for the operands; with 16 (AVX2) half as many. */
#if defined(__AVX512VL__) || defined(__aarch64__)
#define SCORE_KEYS 4
#define VALUE_ACCUMULATORS 24
#else
#define SCORE_KEYS 2
#define VALUE_ACCUMULATORS 12
#endif

typedef struct {
    vf8 qt[MAX_HEAD_DIM][TILE_ROW_VECTORS]; /* queries transposed, in log2 units; pad rows 0 */
    vf8 ot[MAX_HEAD_DIM][TILE_ROW_VECTORS]; /* unnormalised outputs, transposed */
    vf8 s[WIDE_TILE_KEYS][TILE_ROW_VECTORS]; /* this tile's scores, then its weights */
    vf8 max[TILE_ROW_VECTORS], sum[TILE_ROW_VECTORS];
    vi8 first_visible[TILE_ROW_VECTORS], num_visible[TILE_ROW_VECTORS]; /* per row, as in paged_kv.h */
    const elem_t *keys[WIDE_TILE_KEYS], *values[WIDE_TILE_KEYS];
} query_tile;

/* Pack the item's rows: transposed, scaled queries; running max and sum; visible key ranges.
 * Pad rows (up to whole vectors) see every key with zero queries, and are never written out. */
static inline __attribute__((always_inline)) void start_tile(
    query_tile *st, const attention_args *a, const int32_t *item, int kv_head, const int NRV,
    const int D) {
    const int group = a->num_heads / a->num_kv_heads;
    const int num_rows = item[ITEM_NUM_QUERIES] * group;
    const float q_scale = a->scale * LOG2E; /* scores come out in log2 units: exp2 only */
    for (int d = 0; d < D; d++)
        for (int v = 0; v < NRV; v++) st->qt[d][v] = st->ot[d][v] = splat(0.0f);
    for (int v = 0; v < NRV; v++) {
        st->max[v] = splat(-INFINITY);
        st->sum[v] = splat(0.0f);
        st->first_visible[v] = splat_int(0);
        st->num_visible[v] = splat_int(INT32_MAX);
    }
    for (int r = 0; r < num_rows; r++) {
        const int qi = r / group, head = kv_head * group + r % group, v = r / LANES, l = r % LANES;
        const elem_t *src = a->query + (int64_t)(item[ITEM_TOKEN_START] + qi) * a->query_token_stride
                            + (int64_t)head * a->query_head_stride;
        for (int d = 0; d < D; d++) st->qt[d][v][l] = elem_to_float(src[d]) * q_scale;
        if (a->sinks != NULL) { /* the sink as a key seen first: weight exp(0) = 1, value 0 */
            st->max[v][l] = a->sinks[head] * LOG2E;
            st->sum[v][l] = 1.0f;
        }
        st->num_visible[v][l] = row_num_visible(item, qi);
        st->first_visible[v][l] = row_first_visible(a, st->num_visible[v][l]);
    }
}

/* Pointers to the K/V rows of keys pos .. pos + n - 1; false if a block id is out of range. */
static inline __attribute__((always_inline)) int locate_tile(
    query_tile *st, const attention_args *a, const int32_t *blocks, int kv_head, int pos, int n,
    const int D) {
    for (int t = 0; t < n;) {
        const elem_t *keys, *values;
        if (!locate_keys(a, blocks, kv_head, pos + t, D, &keys, &values)) return 0;
        int run = a->block_size - (pos + t) % a->block_size; /* rows left in this block */
        for (int i = 0; i < run && t < n; i++, t++) {
            st->keys[t] = keys + (int64_t)i * D;
            st->values[t] = values + (int64_t)i * D;
        }
    }
    return 1;
}

/* s[t] = qt^T . key t for the tile's n keys: SCORE_KEYS keys x NRV row vectors per step. */
static inline __attribute__((always_inline)) void score_tile(
    query_tile *st, int n, const int NRV, const int D) {
    int t = 0;
    for (; t + SCORE_KEYS <= n; t += SCORE_KEYS) {
        vf8 acc[SCORE_KEYS][TILE_ROW_VECTORS];
        const elem_t *k[SCORE_KEYS];
        for (int i = 0; i < SCORE_KEYS; i++) {
            k[i] = st->keys[t + i];
            for (int v = 0; v < NRV; v++) acc[i][v] = splat(0.0f);
        }
        for (int d = 0; d < D; d++) {
            for (int i = 0; i < SCORE_KEYS; i++) {
                const vf8 key = splat(elem_to_float(k[i][d]));
                for (int v = 0; v < NRV; v++) acc[i][v] += key * st->qt[d][v];
            }
        }
        for (int i = 0; i < SCORE_KEYS; i++)
            for (int v = 0; v < NRV; v++) st->s[t + i][v] = acc[i][v];
    }
    for (; t < n; t++) {
        vf8 acc[TILE_ROW_VECTORS];
        for (int v = 0; v < NRV; v++) acc[v] = splat(0.0f);
        for (int d = 0; d < D; d++)
            for (int v = 0; v < NRV; v++)
                acc[v] += splat(elem_to_float(st->keys[t][d])) * st->qt[d][v];
        for (int v = 0; v < NRV; v++) st->s[t][v] = acc[v];
    }
}

/* Fold the tile's scores into each row's running max and sum and leave its weights in s.
 * masked: some row cannot see some key of the tile (diagonal or window edge). */
static inline __attribute__((always_inline)) void softmax_tile(
    query_tile *st, int n, int pos, int masked, float cap, const int NRV, const int D) {
    for (int v = 0; v < NRV; v++) {
        vf8 tile_max = st->max[v];
        for (int t = 0; t < n; t++) {
            vf8 s = st->s[t][v];
            if (cap > 0.0f) s = soft_cap(s, cap);
            if (masked) {
                vi8 key = splat_int(pos + t);
                s = select((key >= st->first_visible[v]) & (key < st->num_visible[v]), s,
                           splat(-INFINITY));
            }
            st->s[t][v] = s;
            tile_max = vmax(tile_max, s);
        }
        /* A row that has seen no key yet keeps max -inf; subtracting 0 keeps its weights 0. */
        const vf8 shift = select(tile_max == -INFINITY, splat(0.0f), tile_max);
        const vf8 alpha = exp2_nonpositive(st->max[v] - shift);
        vf8 sum = splat(0.0f);
        for (int t = 0; t < n; t++) {
            vf8 weight = exp2_nonpositive(st->s[t][v] - shift);
            if (masked) weight = select(st->s[t][v] == -INFINITY, splat(0.0f), weight);
            st->s[t][v] = weight;
            sum += weight;
        }
        st->sum[v] = st->sum[v] * alpha + sum;
        st->max[v] = tile_max;
        if (any_lane(alpha != 1.0f))
            for (int d = 0; d < D; d++) st->ot[d][v] *= alpha;
    }
}

/* ot[d0 .. d0 + DIMS - 1] += sum over the tile's keys t of value t [d] * s[t], with those dims x
 * NRV row vectors of ot in registers for one pass over the keys. DIMS <= 8. */
static inline __attribute__((always_inline)) void accumulate_dims(
    query_tile *st, int n, int d0, const int DIMS, const int NRV) {
    vf8 acc[8][TILE_ROW_VECTORS];
    for (int i = 0; i < DIMS; i++)
        for (int v = 0; v < NRV; v++) acc[i][v] = st->ot[d0 + i][v];
    for (int t = 0; t < n; t++) {
        const elem_t *value = st->values[t] + d0;
        for (int i = 0; i < DIMS; i++) {
            const vf8 element = splat(elem_to_float(value[i]));
            for (int v = 0; v < NRV; v++) acc[i][v] += element * st->s[t][v];
        }
    }
    for (int i = 0; i < DIMS; i++)
        for (int v = 0; v < NRV; v++) st->ot[d0 + i][v] = acc[i][v];
}

/* ot += values^T . s. VALUE_ACCUMULATORS of ot in registers per pass: each key's weights (NRV
 * loads) and value elements (one broadcast per dim) then feed dims x NRV multiply-adds. */
static inline __attribute__((always_inline)) void accumulate_tile(
    query_tile *st, int n, const int NRV, const int D) {
    const int dims = VALUE_ACCUMULATORS / NRV > 8 ? 8 : VALUE_ACCUMULATORS / NRV;
    int d = 0;
    for (; d + dims <= D; d += dims) accumulate_dims(st, n, d, dims, NRV);
    for (; d < D; d++) accumulate_dims(st, n, d, 1, NRV);
}

static inline __attribute__((always_inline)) void finish_tile(
    const query_tile *st, const attention_args *a, const int32_t *item, int kv_head, const int D) {
    const int group = a->num_heads / a->num_kv_heads;
    for (int r = 0; r < item[ITEM_NUM_QUERIES] * group; r++) {
        const int qi = r / group, head = kv_head * group + r % group, v = r / LANES, l = r % LANES;
        elem_t *dst = a->output + (int64_t)(item[ITEM_TOKEN_START] + qi) * a->output_token_stride
                      + (int64_t)head * D;
        const float inv = 1.0f / st->sum[v][l];
        for (int d = 0; d < D; d++) dst[d] = float_to_elem(st->ot[d][v][l] * inv);
    }
}

/* A query tile of NRV row vectors: every key its rows may see, WIDE_TILE_KEYS at a time. */
static inline __attribute__((always_inline)) int attend_query_tile(
    const attention_args *a, const int32_t *item, int kv_head, const int NRV, const int D) {
    query_tile st;
    const int group = a->num_heads / a->num_kv_heads;
    const int last_row = item[ITEM_NUM_QUERIES] * group - 1;
    const int32_t *blocks = a->block_table + (int64_t)item[ITEM_TABLE_ROW] * a->block_table_stride;
    start_tile(&st, a, item, kv_head, NRV, D);
    /* The first row sees furthest back and least far forward, the last row the opposite: keys
     * in [last row's start, first row's end) are visible to every row, the rest need a mask. */
    const int first_key = st.first_visible[0][0];
    const int end_key = st.num_visible[last_row / LANES][last_row % LANES];
    const int unmasked_from = st.first_visible[last_row / LANES][last_row % LANES];
    const int unmasked_to = st.num_visible[0][0];
    const float cap = a->softcap * LOG2E; /* c * tanh(s / c) scales with the scores' units */
    for (int pos = first_key; pos < end_key; pos += WIDE_TILE_KEYS) {
        const int n = end_key - pos < WIDE_TILE_KEYS ? end_key - pos : WIDE_TILE_KEYS;
        if (!locate_tile(&st, a, blocks, kv_head, pos, n, D)) return CONVEYOR_BAD_BLOCK;
        score_tile(&st, n, NRV, D);
        const int masked = pos < unmasked_from || pos + n > unmasked_to;
        softmax_tile(&st, n, pos, masked, cap, NRV, D);
        accumulate_tile(&st, n, NRV, D);
    }
    finish_tile(&st, a, item, kv_head, D);
    return CONVEYOR_OK;
}

#endif
