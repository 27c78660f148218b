/*
 * What both item paths of the paged-attention kernel share: the call's arguments, the work-item
 * layout, and finding a key's row in the paged cache (included only by paged_attention.c).
 *
 * Cache layout (the torch backend's): [2][num_kv_heads][num_blocks][block_size][head_dim], keys
 * then values.
 */
#ifndef CONVEYOR_PAGED_KV_H
#define CONVEYOR_PAGED_KV_H

#include <stdint.h>

#define MAX_HEAD_DIM 256

enum { CONVEYOR_OK = 0, CONVEYOR_BAD_SHAPE = -1, CONVEYOR_BAD_BLOCK = -2, CONVEYOR_BAD_SLOT = -3 };

/* A work item, as the planner packs it: int32 [4]. Its rows are (query token qi, head g of the
 * kv head's GQA group) -> row qi * group + g. */
enum { ITEM_TABLE_ROW, ITEM_TOKEN_START, ITEM_NUM_QUERIES, ITEM_FIRST_POSITION, ITEM_FIELDS };

typedef struct {
    const float *query;
    int64_t query_token_stride, query_head_stride;
    const float *kv_cache;
    int64_t num_blocks;
    int num_kv_heads, block_size, head_dim, num_heads;
    const int32_t *block_table;
    int64_t block_table_stride;
    float scale;
    int window; /* 0: every earlier key */
    const float *sinks; /* per query head, natural-log units; NULL: none */
    float softcap; /* natural-log units; 0: none */
    float *output;
    int64_t output_token_stride;
} attention_args;

/* Where the key and value of key position pos lie; false if its block id is out of range. */
static inline __attribute__((always_inline)) int locate_keys(
    const attention_args *a, const int32_t *blocks, int kv_head, int pos, const int D,
    const float **keys, const float **values) {
    int32_t block = blocks[pos / a->block_size];
    if (block < 0 || block >= a->num_blocks) return 0;
    int64_t row = ((int64_t)kv_head * a->num_blocks + block) * a->block_size + pos % a->block_size;
    *keys = a->kv_cache + row * D;
    *values = *keys + (int64_t)a->num_kv_heads * a->num_blocks * a->block_size * D;
    return 1;
}

/* Keys row r of an item may see: positions first_visible .. num_visible - 1. */
static inline int row_num_visible(const int32_t *item, int qi) {
    return item[ITEM_FIRST_POSITION] + qi + 1;
}

static inline int row_first_visible(const attention_args *a, int num_visible) {
    return a->window > 0 && num_visible > a->window ? num_visible - a->window : 0;
}

#endif
