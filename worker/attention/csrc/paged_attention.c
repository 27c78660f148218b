/*
 * Paged attention for CPU worker processes: causal attention of query runs of any length
 * (decodes, prompt chunks of any size, in one call) read straight from the paged KV cache
 * through the block table, float32; built again with CONVEYOR_BF16 for bfloat16 models
 * (bfloat16 queries, cache and output) and with CONVEYOR_KV_BF16 for float32 models over a
 * bfloat16 cache (--kv-cache-dtype bfloat16), float32 arithmetic in all three: paged_kv.h.
 *
 * Built on first use by worker/attention/cpu_kernel.py with the system C compiler and loaded with
 * ctypes; plain C (no torch headers) so it compiles in about a second. The caller guarantees
 * types and shapes; this file checks only what would otherwise read out of bounds.
 *
 * One work item is (query run, kv head): up to TILES_PER_ITEM query tiles of TILE_MAX_ROWS query
 * rows (the heads of one GQA group, for consecutive tokens of one request) that all read the same
 * keys, so every key and value row loaded from memory serves the whole item. Items of few rows
 * (decodes) take the short path (short_queries.h), items that fill a vector of rows the
 * query-tile path (query_tiles.h; two tiles share each pass over the keys);
 * both softmax online (one pass over the keys, fp32 throughout), with sliding windows, attention
 * sinks and a logit soft-cap. Threads (OpenMP) take (item, kv head) pairs one at a time,
 * prefetching the start of the next while they compute one.
 *
 * Arithmetic is on 8-float vectors (vector_math.h; the query-tile path also on 16-float ones with
 * AVX-512), so head_dim must be a multiple of 8.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "paged_kv.h"
#include "short_queries.h"
#include "vector_math.h"

/* The query-tile path on 8-float row vectors, and on AVX-512 on 16-float ones as well. */
#define QT_LANES 8
#define QT_OPS_SUFFIX
#include "query_tiles.h"
#if defined(__AVX512F__)
#define WIDE_ROW_LANES 16
#define QT_LANES 16
#define QT_OPS_SUFFIX 16
#include "query_tiles.h"
#endif

#define CONVEYOR_ABI_VERSION 12
/* Items with fewer rows take the short path: below a full vector the query tile's lanes idle. */
#define TILE_MIN_ROWS LANES
/* Query tiles per work item: an item of more query tokens than one tile holds runs as two tiles
 * that share each key tile (attend_query_tile_pair) where AVX-512 has the registers for it. */
#ifdef WIDE_ROW_LANES
#define TILES_PER_ITEM 2
#else
#define TILES_PER_ITEM 1
#endif

int conveyor_abi_version(void) { return CONVEYOR_ABI_VERSION; }

/* Bytes per query and output element: 4 (float32), or 2 in a CONVEYOR_BF16 build. */
int conveyor_element_bytes(void) { return (int)sizeof(io_t); }

/* Rows (query tokens x GQA group) one query tile may hold in this build. */
int conveyor_tile_max_rows(void) { return TILE_MAX_ROWS; }

/* Query tiles one work item may hold, each of whole GQA groups: TILE_MAX_ROWS / group tokens. */
int conveyor_tiles_per_item(void) { return TILES_PER_ITEM; }

/* Bytes per cache element: 2 in a CONVEYOR_BF16 or CONVEYOR_KV_BF16 build, else 4. */
int conveyor_kv_element_bytes(void) { return (int)sizeof(kv_t); }

/* One function per row-vector width, row-vector count and head dim: constants let the compiler
 * keep the accumulators in registers and unroll the inner loops fully, and a function of its
 * own keeps each variant's hot loops from being laid out around the others' code (inlined side
 * by side, adding a prefetch to the one-vector variant slowed the two-vector one by 5-10 %). */
#define TILE_VARIANT(W, NRV, D)                                                                  \
    static __attribute__((noinline)) int tile_##W##x##NRV##_d##D(                               \
        const attention_args *a, const int32_t *item, int kv_head) {                            \
        return attend_query_tile_##W(a, item, kv_head, NRV, D ? D : a->head_dim);               \
    }
/* Head dims 64 and 128 specialised, any other (D 0) read at run time. */
#define TILE_VARIANTS(W, NRV)                                                                    \
    TILE_VARIANT(W, NRV, 64) TILE_VARIANT(W, NRV, 128) TILE_VARIANT(W, NRV, 0)
#define CALL_TILE_VARIANT(W, NRV)                                                                \
    (a->head_dim == 64    ? tile_##W##x##NRV##_d64(a, item, kv_head)                            \
     : a->head_dim == 128 ? tile_##W##x##NRV##_d128(a, item, kv_head)                           \
                          : tile_##W##x##NRV##_d0(a, item, kv_head))

TILE_VARIANTS(8, 1)
#ifdef WIDE_ROW_LANES
TILE_VARIANTS(16, 1)
TILE_VARIANTS(16, 2)
TILE_VARIANTS(16, 3)
TILE_VARIANTS(16, 4)
#else
TILE_VARIANTS(8, 2)
TILE_VARIANTS(8, 3)
TILE_VARIANTS(8, 4)
#endif

#ifdef WIDE_ROW_LANES
#define PAIR_VARIANT(NRV_B, D)                                                                    \
    static __attribute__((noinline)) int pair_16x4_##NRV_B##_d##D(                              \
        const attention_args *a, const int32_t *item, int kv_head) {                            \
        return attend_query_tile_pair_16(a, item, kv_head, 4, NRV_B, D ? D : a->head_dim);       \
    }
#define PAIR_VARIANTS(NRV_B) PAIR_VARIANT(NRV_B, 64) PAIR_VARIANT(NRV_B, 128) PAIR_VARIANT(NRV_B, 0)
#define CALL_PAIR_VARIANT(NRV_B)                                                                  \
    (a->head_dim == 64    ? pair_16x4_##NRV_B##_d64(a, item, kv_head)                           \
     : a->head_dim == 128 ? pair_16x4_##NRV_B##_d128(a, item, kv_head)                          \
                          : pair_16x4_##NRV_B##_d0(a, item, kv_head))
PAIR_VARIANTS(1)
PAIR_VARIANTS(2)
PAIR_VARIANTS(3)
PAIR_VARIANTS(4)
#endif

static int attend_item_any_dim(const attention_args *a, const int32_t *item, int kv_head);

/* An item of one 8-float vector of rows stays on that width; with AVX-512, fuller items take
 * 16-float row vectors. */
static int attend_tile_any_shape(const attention_args *a, const int32_t *item, int kv_head,
                                 int num_rows) {
#ifdef WIDE_ROW_LANES
    const int group = a->num_heads / a->num_kv_heads;
    const int tokens_a = TILE_MAX_ROWS / group; /* whole GQA groups in one tile */
    if (item[ITEM_NUM_QUERIES] > tokens_a) { /* two tiles: the first full, the rest */
        const int rows_b = (item[ITEM_NUM_QUERIES] - tokens_a) * group;
        /* A pair where its first tile fills four row vectors (more than 48 rows: every GQA
         * group but 22-24 and 33-48) and its second is more than one 8-float vector. */
        if (a->window == 0 && tokens_a * group > 3 * WIDE_ROW_LANES && rows_b > LANES) {
            switch ((rows_b + WIDE_ROW_LANES - 1) / WIDE_ROW_LANES) {
            case 1: return CALL_PAIR_VARIANT(1);
            case 2: return CALL_PAIR_VARIANT(2);
            case 3: return CALL_PAIR_VARIANT(3);
            default: return CALL_PAIR_VARIANT(4);
            }
        }
        /* A window (the halves would start on different key grids) or a second half small
         * enough for another path: the two halves one after the other, as two items. */
        int32_t halves[2][ITEM_FIELDS];
        split_item(item, tokens_a, halves);
        const int status = attend_item_any_dim(a, halves[0], kv_head);
        return status != CONVEYOR_OK ? status : attend_item_any_dim(a, halves[1], kv_head);
    }
#endif
    if (num_rows <= LANES) return CALL_TILE_VARIANT(8, 1);
#ifdef WIDE_ROW_LANES
    if (num_rows <= WIDE_ROW_LANES) return CALL_TILE_VARIANT(16, 1);
    if (num_rows <= 2 * WIDE_ROW_LANES) return CALL_TILE_VARIANT(16, 2);
    if (num_rows <= 3 * WIDE_ROW_LANES) return CALL_TILE_VARIANT(16, 3);
    return CALL_TILE_VARIANT(16, 4);
#else
    switch ((num_rows + LANES - 1) / LANES) {
    case 2: return CALL_TILE_VARIANT(8, 2);
    case 3: return CALL_TILE_VARIANT(8, 3);
    default: return CALL_TILE_VARIANT(8, 4);
    }
#endif
}

static int attend_item_any_dim(const attention_args *a, const int32_t *item, int kv_head) {
    const int num_rows = item[ITEM_NUM_QUERIES] * (a->num_heads / a->num_kv_heads);
    if (num_rows < TILE_MIN_ROWS) {
        switch (a->head_dim) {
        case 64: return attend_short_item(a, item, kv_head, 64);
        case 128: return attend_short_item(a, item, kv_head, 128);
        default: return attend_short_item(a, item, kv_head, a->head_dim);
        }
    }
    return attend_tile_any_shape(a, item, kv_head, num_rows);
}

/* The first keys of a pair that this thread will take next, asked for while it still works on
 * the one before: an item's own prefetches run LOOKAHEAD_TILES ahead of its current tile, so
 * its first tiles would otherwise wait on memory with nothing in flight. Only items of at most
 * one 8-float vector of rows (decodes), which do too little work per key to hide that wait. */
static void prefetch_item_start(const attention_args *a, const int32_t *item, int kv_head) {
    if (item[ITEM_NUM_QUERIES] * (a->num_heads / a->num_kv_heads) > LANES) return;
    const int first = row_first_visible(a, row_num_visible(item, 0));
    const int end = item[ITEM_FIRST_POSITION] + item[ITEM_NUM_QUERIES];
    const int tile = a->block_size < TILE_KEYS ? a->block_size : TILE_KEYS;
    const int n = end - first < LOOKAHEAD_TILES * tile ? end - first : LOOKAHEAD_TILES * tile;
    const int32_t *blocks = a->block_table + (int64_t)item[ITEM_TABLE_ROW] * a->block_table_stride;
    prefetch_keys(a, blocks, kv_head, first, n, a->head_dim);
}

/* Attend every (item, kv head) pair; items are int32 [num_items][ITEM_FIELDS]. Writes the
 * query heads' outputs to output[token][head][dim]. Returns CONVEYOR_OK or a negative error. */
int conveyor_paged_attention(
    const io_t *query, int64_t query_token_stride, int64_t query_head_stride,
    const kv_t *kv_cache, int num_kv_heads, int64_t num_blocks, int block_size, int head_dim,
    int num_heads, const int32_t *block_table, int64_t block_table_stride,
    const int32_t *items, int num_items, float scale, int window, const float *sinks,
    float softcap, io_t *output,
    int64_t output_token_stride, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim <= 0 || head_dim % LANES
        || head_dim > MAX_HEAD_DIM || block_size <= 0 || window < 0 || softcap < 0.0f)
        return CONVEYOR_BAD_SHAPE;
    const int group = num_heads / num_kv_heads;
    for (int i = 0; i < num_items; i++)
        if (group > TILE_MAX_ROWS
            || items[i * ITEM_FIELDS + ITEM_NUM_QUERIES] > TILES_PER_ITEM * (TILE_MAX_ROWS / group))
            return CONVEYOR_BAD_SHAPE;
    attention_args a = {query, query_token_stride, query_head_stride, kv_cache, num_blocks,
                        num_kv_heads, block_size, head_dim, num_heads, block_table,
                        block_table_stride, scale, window, sinks, softcap, output,
                        output_token_stride};
    int status = CONVEYOR_OK;
    const int64_t num_pairs = (int64_t)num_items * num_kv_heads;
    /* Pairs go to threads one at a time, as they free up (pairs differ in context length; the
     * planner puts the longest first), each thread claiming its next pair when it starts one,
     * so that pair's first keys can be on their way while this one computes. */
    int64_t unclaimed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        int64_t pair, following;
#pragma omp atomic capture
        pair = unclaimed++;
        while (pair < num_pairs) {
#pragma omp atomic capture
            following = unclaimed++;
            if (following < num_pairs)
                prefetch_item_start(&a, items + following / num_kv_heads * ITEM_FIELDS,
                                    (int)(following % num_kv_heads));
            const int32_t *item = items + pair / num_kv_heads * ITEM_FIELDS;
            if (attend_item_any_dim(&a, item, (int)(pair % num_kv_heads)) != CONVEYOR_OK) {
#pragma omp atomic write
                status = CONVEYOR_BAD_BLOCK;
            }
            pair = following;
        }
    }
    return status;
}

/* Store each token's key and value rows (any token and head strides, dense rows) at its slot,
 * block_id * block_size + offset, for every kv head; into a bfloat16 cache from float32 rows
 * (CONVEYOR_KV_BF16) each element rounded to the nearest, ties to even, as torch's .to() rounds.
 * A plain copy on the calling thread: a step's few hundred rows are less work than waking the
 * thread pool, and torch's index_copy_ costs several times more per call. Slots are checked
 * before anything is written. */
static inline void store_kv_row(kv_t *dst, const io_t *src, int head_dim) {
#if defined(CONVEYOR_KV_BF16)
    int d = 0;
    for (; d + LANES <= head_dim; d += LANES) store_bf16(dst + d, load(src + d));
    for (; d < head_dim; d++) dst[d] = float_to_bf16(src[d]);
#else
    memcpy(dst, src, (size_t)head_dim * sizeof(kv_t));
#endif
}

int conveyor_write_kv(
    kv_t *kv_cache, int num_kv_heads, int64_t num_slots, int head_dim, const io_t *key,
    int64_t key_token_stride, int64_t key_head_stride, const io_t *value,
    int64_t value_token_stride, int64_t value_head_stride, const int64_t *slot_mapping,
    int num_tokens) {
    for (int i = 0; i < num_tokens; i++)
        if (slot_mapping[i] < 0 || slot_mapping[i] >= num_slots) return CONVEYOR_BAD_SLOT;
    for (int h = 0; h < num_kv_heads; h++) {
        kv_t *keys = kv_cache + (int64_t)h * num_slots * head_dim;
        kv_t *values = kv_cache + (int64_t)(num_kv_heads + h) * num_slots * head_dim;
        for (int i = 0; i < num_tokens; i++) {
            int64_t slot = slot_mapping[i];
            store_kv_row(keys + slot * head_dim, key + i * key_token_stride + h * key_head_stride,
                         head_dim);
            store_kv_row(values + slot * head_dim,
                         value + i * value_token_stride + h * value_head_stride, head_dim);
        }
    }
    return CONVEYOR_OK;
}
