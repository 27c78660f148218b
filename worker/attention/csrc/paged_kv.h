/*
 * What both item paths of the paged-attention kernel share: the call's arguments, the work-item
 * layout, and finding a key's row in the paged cache (included only by paged_attention.c).
 *
 * Cache layout (the torch backend's): [2][num_kv_heads][num_blocks][block_size][head_dim], keys
 * then values.
 *
 * Queries, the cache and the output are float32; or all bfloat16 in a build with CONVEYOR_BF16;
 * or float32 queries and output over a bfloat16 cache with CONVEYOR_KV_BF16 (--kv-cache-dtype
 * bfloat16 on a float32 model). bfloat16 elements are widened to float32 as they are loaded,
 * every product, sum and softmax runs in float32, and bfloat16 outputs are rounded to the nearest
 * (ties to even, as torch rounds) once, when they are written.
 */
#ifndef CONVEYOR_PAGED_KV_H
#define CONVEYOR_PAGED_KV_H

#include <stdint.h>
#include <string.h>

#include "vector_math.h"

#define MAX_HEAD_DIM 256

/* io_t: the queries and the outputs, the model's dtype; kv_t: the cache's elements. */
#if defined(CONVEYOR_BF16)
typedef uint16_t io_t; /* the bits of a bfloat16 */
#else
typedef float io_t;
#endif
#if defined(CONVEYOR_BF16) || defined(CONVEYOR_KV_BF16)
typedef uint16_t kv_t;
#else
typedef float kv_t;
#endif

#if defined(CONVEYOR_BF16)
static inline float io_to_float(io_t x) { return bf16_to_float(x); }
static inline io_t float_to_io(float f) { return float_to_bf16(f); }
static inline vf8 load_io(const io_t *p) { return load_bf16(p); }
static inline void store_io(io_t *p, vf8 v) { store_bf16(p, v); }
#else
static inline float io_to_float(io_t x) { return x; }
static inline io_t float_to_io(float f) { return f; }
static inline vf8 load_io(const io_t *p) { return load(p); }
static inline void store_io(io_t *p, vf8 v) { store(p, v); }
#endif
#if defined(CONVEYOR_BF16) || defined(CONVEYOR_KV_BF16)
static inline float kv_to_float(kv_t x) { return bf16_to_float(x); }
static inline vf8 load_kv(const kv_t *p) { return load_bf16(p); }
#else
static inline float kv_to_float(kv_t x) { return x; }
static inline vf8 load_kv(const kv_t *p) { return load(p); }
#endif
/* Elements per 64-byte cache line, the step of the software prefetches. */
#define CACHE_LINE_ELEMS ((int)(64 / sizeof(kv_t)))

enum { CONVEYOR_OK = 0, CONVEYOR_BAD_SHAPE = -1, CONVEYOR_BAD_BLOCK = -2, CONVEYOR_BAD_SLOT = -3 };

/* A work item, as the planner packs it: int32 [4]. Its rows are (query token qi, head g of the
 * kv head's GQA group) -> row qi * group + g. */
enum { ITEM_TABLE_ROW, ITEM_TOKEN_START, ITEM_NUM_QUERIES, ITEM_FIRST_POSITION, ITEM_FIELDS };

typedef struct {
    const io_t *query;
    int64_t query_token_stride, query_head_stride;
    const kv_t *kv_cache;
    int64_t num_blocks;
    int num_kv_heads, block_size, head_dim, num_heads;
    const int32_t *block_table;
    int64_t block_table_stride;
    float scale;
    int window; /* 0: every earlier key */
    const float *sinks; /* per query head, natural-log units; NULL: none */
    float softcap; /* natural-log units; 0: none */
    io_t *output;
    int64_t output_token_stride;
} attention_args;

/* Where the key and value of key position pos lie; false if its block id is out of range. */
static inline __attribute__((always_inline)) int locate_keys(
    const attention_args *a, const int32_t *blocks, int kv_head, int pos, const int D,
    const kv_t **keys, const kv_t **values) {
    int32_t block = blocks[pos / a->block_size];
    if (block < 0 || block >= a->num_blocks) return 0;
    int64_t row = ((int64_t)kv_head * a->num_blocks + block) * a->block_size + pos % a->block_size;
    *keys = a->kv_cache + row * D;
    *values = *keys + (int64_t)a->num_kv_heads * a->num_blocks * a->block_size * D;
    return 1;
}

/* Tiles ahead whose K/V rows both paths prefetch while a tile computes: fetching only the next
 * one left the loads waiting (decodes read 1.2-1.5x faster 2 ahead into L2 than 1 ahead into
 * L1; 3 or 4 ahead were no faster). */
#define LOOKAHEAD_TILES 2

/* Ask for the K/V rows of keys pos .. pos + n - 1 into L2, ahead of their use: a tile's compute is
 * shorter than a trip to memory, and a tile's blocks lie at addresses the hardware prefetchers
 * cannot guess. A block id out of range is left for the caller's own lookup to report. */
static inline __attribute__((always_inline)) void prefetch_keys(
    const attention_args *a, const int32_t *blocks, int kv_head, int pos, int n, const int D) {
    for (int end = pos + n; pos < end;) {
        const kv_t *keys, *values;
        if (!locate_keys(a, blocks, kv_head, pos, D, &keys, &values)) return;
        int run = a->block_size - pos % a->block_size; /* rows left in this block */
        run = run < end - pos ? run : end - pos;
        for (int64_t c = 0; c < (int64_t)run * D; c += CACHE_LINE_ELEMS) {
            __builtin_prefetch(keys + c, 0, 1);
            __builtin_prefetch(values + c, 0, 1);
        }
        pos += run;
    }
}

/* Keys row r of an item may see: positions first_visible .. num_visible - 1. */
static inline int row_num_visible(const int32_t *item, int qi) {
    return item[ITEM_FIRST_POSITION] + qi + 1;
}

static inline int row_first_visible(const attention_args *a, int num_visible) {
    return a->window > 0 && num_visible > a->window ? num_visible - a->window : 0;
}

/* An item cut after its first ``tokens`` query tokens: halves[0] those, halves[1] the rest, each
 * an item of its own (the same table row, positions following on). */
static inline void split_item(const int32_t *item, int tokens, int32_t halves[2][ITEM_FIELDS]) {
    for (int h = 0; h < 2; h++) {
        const int skip = h == 0 ? 0 : tokens;
        halves[h][ITEM_TABLE_ROW] = item[ITEM_TABLE_ROW];
        halves[h][ITEM_TOKEN_START] = item[ITEM_TOKEN_START] + skip;
        halves[h][ITEM_NUM_QUERIES] = h == 0 ? tokens : item[ITEM_NUM_QUERIES] - tokens;
        halves[h][ITEM_FIRST_POSITION] = item[ITEM_FIRST_POSITION] + skip;
    }
}

#endif
