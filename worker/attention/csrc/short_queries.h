/*
 * The paged-attention kernel's path for items of few query rows (decodes, and the last tokens of
 * a prompt chunk): included only by paged_attention.c.
 *
 * Each key is scored against every row as one dot product over head_dim, so a key row loaded
 * once serves all of the item's rows with no repacking; with few rows that beats the query-tile
 * path (query_tiles.h), whose packed layout pays off only once the rows fill a vector. Softmax is
 * the online (flash) form: one pass over the keys, a running max and sum per row, fp32
 * throughout. With a sliding window an item starts at its first row's first visible key, so keys
 * behind every row's window are never read (their blocks may already belong to another request).
 * Attention sinks start each row's running max at the sink and its sum at 1: the online softmax
 * then folds the sink in as one more key. A logit soft-cap maps every score s to c * tanh(s / c).
 */
#ifndef CONVEYOR_SHORT_QUERIES_H
#define CONVEYOR_SHORT_QUERIES_H

#include "paged_kv.h"
#include "vector_math.h"

/* Rows a short item may have (the planner sends more only as query tiles). */
#define SHORT_MAX_ROWS 16
/* Keys scored before each softmax update: enough to amortise the rescale of the accumulators,
 * few enough that the scores stay in L1. A multiple of LANES. */
#define TILE_KEYS 32
#define TILE_VECTORS (TILE_KEYS / LANES)
#define HEAD_VECTORS (MAX_HEAD_DIM / LANES)

typedef struct {
    vf8 q[SHORT_MAX_ROWS][HEAD_VECTORS];   /* queries, pre-scaled to log2 units */
    vf8 acc[SHORT_MAX_ROWS][HEAD_VECTORS]; /* unnormalised outputs */
    vf8 p[SHORT_MAX_ROWS][TILE_VECTORS];   /* this tile's scores, then its softmax weights */
    float max[SHORT_MAX_ROWS], sum[SHORT_MAX_ROWS];
    int num_visible[SHORT_MAX_ROWS]; /* keys row r may see end here: its position + 1 */
    int first_visible[SHORT_MAX_ROWS]; /* and start here: 0, or the start of its sliding window */
} short_state;

/* Scores of num_keys consecutive keys against every row, into st->p. ahead_keys / ahead_values
 * (or NULL) are the first num_ahead rows of a tile LOOKAHEAD_TILES on: fetched into L2 while
 * this tile computes, since tiles usually start new blocks, at addresses the hardware prefetcher
 * cannot guess. Spread one key row per scored key: issued in one burst at the tile's start
 * (prefetch_keys, as the query-tile path does, whose tiles compute far longer per key), decodes
 * ran at 0.65-0.77x. */
static inline __attribute__((always_inline)) void score_keys(
    short_state *st, int num_rows, const float *keys, int num_keys, const kv_t *ahead_keys,
    const kv_t *ahead_values, int num_ahead, const float cap, const int D) {
    for (int t = 0; t < num_keys; t++) {
        const float *k = keys + (int64_t)t * D;
        if (ahead_keys != NULL && t < num_ahead) {
            for (int c = 0; c < D; c += CACHE_LINE_ELEMS) {
                __builtin_prefetch(ahead_keys + (int64_t)t * D + c, 0, 1);
                __builtin_prefetch(ahead_values + (int64_t)t * D + c, 0, 1);
            }
        }
        for (int r = 0; r < num_rows; r++) {
            /* Two partial sums halve the dependency chain of the fused multiply-adds. */
            vf8 even = splat(0.0f), odd = splat(0.0f);
            int j = 0;
            for (; j + 1 < D / LANES; j += 2) {
                even += st->q[r][j] * load(k + j * LANES);
                odd += st->q[r][j + 1] * load(k + (j + 1) * LANES);
            }
            if (j < D / LANES) even += st->q[r][j] * load(k + j * LANES);
            float score = hsum(even + odd);
            /* cap is in the scores' log2 units: c * tanh(s / c) scales with them. */
            if (cap > 0.0f) score = cap * tanhf(score / cap);
            st->p[r][t / LANES][t % LANES] = score;
        }
    }
}

/* Fold row r's scores into its running max and sum; leave its softmax weights in st->p[r]. */
static inline __attribute__((always_inline)) void softmax_row(
    short_state *st, int r, int num_keys, int key_pos, const int D) {
    int visible = st->num_visible[r] - key_pos;
    visible = visible < num_keys ? visible : num_keys;
    const int hidden = st->first_visible[r] - key_pos; /* keys of this tile before the window */
    const vi8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
    vf8 tile_max = splat(-INFINITY);
    for (int i = 0; i * LANES < num_keys; i++) {
        vi8 present = (lane + i * LANES < visible) & (lane + i * LANES >= hidden);
        tile_max = vmax(tile_max, select(present, st->p[r][i], splat(-INFINITY)));
    }
    float new_max = hmax(tile_max);
    if (new_max < st->max[r]) new_max = st->max[r];
    if (new_max == -INFINITY) { /* nothing visible yet: this row's weights are all 0 */
        for (int i = 0; i * LANES < num_keys; i++) st->p[r][i] = splat(0.0f);
        return;
    }
    float alpha = exp2_nonpositive(splat(st->max[r] - new_max))[0];
    if (alpha != 1.0f) {
        for (int j = 0; j < D / LANES; j++) st->acc[r][j] *= alpha;
        st->sum[r] *= alpha;
    }
    vf8 sum = splat(0.0f);
    for (int i = 0; i * LANES < num_keys; i++) {
        vi8 present = (lane + i * LANES < visible) & (lane + i * LANES >= hidden);
        vf8 weight = select(present, exp2_nonpositive(st->p[r][i] - new_max), splat(0.0f));
        st->p[r][i] = weight;
        sum += weight;
    }
    st->sum[r] += hsum(sum);
    st->max[r] = new_max;
}

/* acc[r] += sum over t of p[r][t] * values[t], four vectors of acc held in registers at once. */
static inline __attribute__((always_inline)) void accumulate_values(
    short_state *st, int num_rows, const float *values, int num_keys, const int D) {
    for (int r = 0; r < num_rows; r++) {
        const float *p = (const float *)st->p[r];
        int j = 0;
        for (; j + 4 <= D / LANES; j += 4) {
            vf8 a0 = st->acc[r][j], a1 = st->acc[r][j + 1];
            vf8 a2 = st->acc[r][j + 2], a3 = st->acc[r][j + 3];
            for (int t = 0; t < num_keys; t++) {
                const float *v = values + (int64_t)t * D + j * LANES;
                vf8 w = splat(p[t]);
                a0 += w * load(v);
                a1 += w * load(v + LANES);
                a2 += w * load(v + 2 * LANES);
                a3 += w * load(v + 3 * LANES);
            }
            st->acc[r][j] = a0, st->acc[r][j + 1] = a1;
            st->acc[r][j + 2] = a2, st->acc[r][j + 3] = a3;
        }
        for (; j < D / LANES; j++) {
            vf8 a = st->acc[r][j];
            for (int t = 0; t < num_keys; t++)
                a += splat(p[t]) * load(values + (int64_t)t * D + j * LANES);
            st->acc[r][j] = a;
        }
    }
}

/* Load the item's query rows, (query token qi, head g of the group) -> row qi * group + g. */
static inline __attribute__((always_inline)) void start_rows(
    short_state *st, const attention_args *a, const int32_t *item, int kv_head, const int D) {
    const int group = a->num_heads / a->num_kv_heads;
    /* Scores come out in log2 units, so the softmax needs exp2 only. */
    const float q_scale = a->scale * LOG2E;
    for (int r = 0; r < item[ITEM_NUM_QUERIES] * group; r++) {
        int qi = r / group, head = kv_head * group + r % group;
        const io_t *src = a->query + (int64_t)(item[ITEM_TOKEN_START] + qi) * a->query_token_stride
                            + (int64_t)head * a->query_head_stride;
        for (int j = 0; j < D / LANES; j++) {
            st->q[r][j] = load_io(src + j * LANES) * q_scale;
            st->acc[r][j] = splat(0.0f);
        }
        if (a->sinks != NULL) { /* the sink as a key seen first: weight exp(0) = 1, value 0 */
            st->max[r] = a->sinks[head] * LOG2E;
            st->sum[r] = 1.0f;
        } else {
            st->max[r] = -INFINITY;
            st->sum[r] = 0.0f;
        }
        st->num_visible[r] = row_num_visible(item, qi);
        st->first_visible[r] = row_first_visible(a, st->num_visible[r]);
    }
}

static inline __attribute__((always_inline)) void finish_rows(
    const short_state *st, const attention_args *a, const int32_t *item, int kv_head, const int D) {
    const int group = a->num_heads / a->num_kv_heads;
    for (int r = 0; r < item[ITEM_NUM_QUERIES] * group; r++) {
        int qi = r / group, head = kv_head * group + r % group;
        io_t *dst = a->output + (int64_t)(item[ITEM_TOKEN_START] + qi) * a->output_token_stride
                      + (int64_t)head * D;
        float inv = 1.0f / st->sum[r];
        for (int j = 0; j < D / LANES; j++) store_io(dst + j * LANES, st->acc[r][j] * inv);
    }
}

#if defined(CONVEYOR_BF16) || defined(CONVEYOR_KV_BF16)
/* n consecutive cache rows of D elements (a tile never crosses a block), as float32. */
static inline __attribute__((always_inline)) void widen_rows(float *dst, const kv_t *src, int n,
                                                            const int D) {
    for (int64_t i = 0; i < (int64_t)n * D; i += LANES) store(dst + i, load_kv(src + i));
}
#endif

/* A short item: every key its rows may see, tile by tile, never crossing a block. */
static inline __attribute__((always_inline)) int attend_short_item(
    const attention_args *a, const int32_t *item, int kv_head, const int D) {
    short_state st;
    const int num_rows = item[ITEM_NUM_QUERIES] * (a->num_heads / a->num_kv_heads);
    const int num_keys = item[ITEM_FIRST_POSITION] + item[ITEM_NUM_QUERIES];
    const int bs = a->block_size;
    const int32_t *blocks = a->block_table + (int64_t)item[ITEM_TABLE_ROW] * a->block_table_stride;
    const kv_t *keys, *values, *next_keys = NULL, *next_values = NULL;
#if defined(CONVEYOR_BF16) || defined(CONVEYOR_KV_BF16)
    float tile_keys[TILE_KEYS * MAX_HEAD_DIM], tile_values[TILE_KEYS * MAX_HEAD_DIM];
#endif
    start_rows(&st, a, item, kv_head, D);
    const int first_key = st.first_visible[0]; /* the item's earliest row sees furthest back */
    if (!locate_keys(a, blocks, kv_head, first_key, D, &keys, &values)) return CONVEYOR_BAD_BLOCK;
    const int tile_step = bs < TILE_KEYS ? bs : TILE_KEYS; /* a whole tile's length */
    for (int pos = first_key; pos < num_keys;) {
        int num = bs - pos % bs;
        num = num < TILE_KEYS ? num : TILE_KEYS;
        num = num < num_keys - pos ? num : num_keys - pos;
        if (pos + num < num_keys
            && !locate_keys(a, blocks, kv_head, pos + num, D, &next_keys, &next_values))
            return CONVEYOR_BAD_BLOCK;
        /* Rows from `ahead` on, as many as this tile has, up to the end of their block. */
        const kv_t *ahead_keys = NULL, *ahead_values = NULL;
        const int ahead = pos + LOOKAHEAD_TILES * tile_step;
        if (ahead < num_keys
            && !locate_keys(a, blocks, kv_head, ahead, D, &ahead_keys, &ahead_values))
            return CONVEYOR_BAD_BLOCK;
        int num_ahead = bs - ahead % bs;
        num_ahead = num_ahead < num ? num_ahead : num;
#if defined(CONVEYOR_BF16) || defined(CONVEYOR_KV_BF16)
        /* A bfloat16 tile is widened once into L1, then read by every row as float32: widened
         * at each use, each row of the GQA group paid for it again. */
        widen_rows(tile_keys, keys, num, D);
        widen_rows(tile_values, values, num, D);
#else
        const float *tile_keys = keys, *tile_values = values;
#endif
        score_keys(&st, num_rows, tile_keys, num, ahead_keys, ahead_values, num_ahead,
                   a->softcap * LOG2E, D);
        for (int r = 0; r < num_rows; r++) softmax_row(&st, r, num, pos, D);
        accumulate_values(&st, num_rows, tile_values, num, D);
        pos += num;
        keys = next_keys;
        values = next_values;
        next_keys = next_values = NULL;
    }
    finish_rows(&st, a, item, kv_head, D);
    return CONVEYOR_OK;
}

#endif
